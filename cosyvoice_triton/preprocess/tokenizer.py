"""The Qwen2 text tokenizer of CosyVoice2, built with the `tokenizers` library (no transformers).

A released `CosyVoice-BlankEN/` folder holds `vocab.json` + `merges.txt` (byte-level BPE) and
`tokenizer_config.json`, whose `added_tokens_decoder` lists the added tokens with their ids
(`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ...). A `tokenizer.json`, if present, is used
instead of the two vocabulary files. On top, the model family registers its own special tokens
(`ModelFamily.special_tokens`: CosyVoice2's, or CosyVoice3's, which add pronunciation tokens after them);
those not yet known get the next free ids in list order, so `<|endofprompt|>` is id 151646 with the released
vocabulary. Special tokens are matched in the
raw text and always encode to one id (the official `allowed_special='all'`).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from cosyvoice_triton.errors import ModelFolderError
from cosyvoice_triton.family import COSYVOICE2_SPECIAL_TOKENS

# How Qwen2 cuts text into words before BPE: contractions, letter runs with one leading non-letter,
# single digits, punctuation runs, newlines, other whitespace.
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

def qwen2_pipeline(model: models.BPE) -> Tokenizer:
    """A tokenizer with Qwen2's normalizer, pre-tokenizer, decoder and post-processor around `model`."""
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _config_added_tokens(config: dict) -> list[tuple[int, AddedToken]]:
    """(id, token) pairs from `added_tokens_decoder`, in id order."""
    pairs = []
    for token_id, spec in config.get("added_tokens_decoder", {}).items():
        token = AddedToken(spec["content"], single_word=spec.get("single_word", False),
                           lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                           normalized=spec.get("normalized", False), special=spec.get("special", True))
        pairs.append((int(token_id), token))
    return sorted(pairs, key=lambda pair: pair[0])


def _add_config_tokens(tokenizer: Tokenizer, config: dict, folder: Path) -> None:
    """Register the folder's added tokens and check that each lands on its configured id."""
    for token_id, token in _config_added_tokens(config):
        if tokenizer.token_to_id(token.content) is None and token.special:
            tokenizer.add_special_tokens([token])
        elif tokenizer.token_to_id(token.content) is None:
            tokenizer.add_tokens([token])
        if tokenizer.token_to_id(token.content) != token_id:
            raise ModelFolderError(f"{folder}: added token {token.content!r} should have id {token_id}, "
                                   f"got {tokenizer.token_to_id(token.content)}")


def _load_base(folder: Path) -> Tokenizer:
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.is_file():
        return Tokenizer.from_file(str(tokenizer_json))
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise ModelFolderError(f"{folder}: no tokenizer.json and no vocab.json + merges.txt")
    return qwen2_pipeline(models.BPE.from_file(str(vocab), str(merges)))


class TextTokenizer:
    """Text ↔ Qwen2 token ids, with CosyVoice2's special tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, qwen_dir: str | Path, special_tokens: Sequence[str] = COSYVOICE2_SPECIAL_TOKENS) -> TextTokenizer:
        """The tokenizer of a `CosyVoice-BlankEN/` folder with `special_tokens` (the family's) added."""
        folder = Path(qwen_dir)
        tokenizer = _load_base(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        _add_config_tokens(tokenizer, config, folder)
        missing = [t for t in special_tokens if tokenizer.token_to_id(t) is None]
        tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in missing])
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def count(self, text: str) -> int:
        """Number of tokens of `text` (sentence splitting measures English sentences with it)."""
        return len(self.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)
