"""Text normalization and sentence splitting, with the semantics of the official CosyVoice2/3 frontend.

Pipeline for one request text (`TextPreprocessor.split`, after `validate_text`):
  1. Text containing `<|` and `|>` (SSML-like markup) is passed through untouched, as one piece.
  2. Chinese text (any CJK ideograph): wetext normalization (`lang="zh"`, erhua kept), then the
     clean-ups: newlines dropped, blanks between non-ASCII characters removed, `²`/`³` spelled,
     `.` → `。`, ` - ` → `，`, brackets and back-ticks removed, `——` → space, a trailing run of
     commas → `。`.
  3. Other text: wetext normalization (`lang="en"`), then every remaining run of digits is spelled
     out in English words (`spell_out_integer`, inflect's wording: "one hundred and one").
  4. Splitting at sentence punctuation, merging pieces up to `TOKEN_MAX_N` (Chinese counts
     characters, other text counts tokens, as the official code does), appending a last piece
     shorter than `MERGE_LEN` to the previous one.
  5. Pieces made only of punctuation and symbols are dropped.

Two deliberate differences: the official code runs wetext with `lang="auto"`, which treats an
all-digit string such as "2024" as Chinese even in English text; we pass the language we detected. And the
family's verbatim tokens (CosyVoice3's pronunciation hints, `[j][ǐ]`, `[HH][AH0]`) pass through untouched,
the text between them normalized piece by piece: the official wetext path turns the digit of `[AA1]` into
`一` in Chinese text and fails on it in English text.

`TextPreprocessor` also holds the family (`family.ModelFamily`), whose text forms the pipeline lays out
(the prompt prefix, the instruction form) and whose special tokens the tokenizer knows.
"""
from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from cosyvoice_triton.config import ModelPaths
from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.family import COSYVOICE2, ModelFamily
from cosyvoice_triton.preprocess.tokenizer import TextTokenizer
from cosyvoice_triton.wire.checks import DEFAULT_MAX_CHARS


TOKEN_MAX_N = 80  # a merged sentence stops growing past this length ...
TOKEN_MIN_N = 60  # ... once it is longer than this
MERGE_LEN = 20  # a last sentence shorter than this joins the one before

ZH_SENTENCE_MARKS = frozenset("。？！；：、.?!;")
EN_SENTENCE_MARKS = frozenset(".?!;:")
CLOSING_QUOTES = frozenset('"”')

_CJK = re.compile(r"[\u4e00-\u9fff]")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_DIGIT_RUN = re.compile(r"\d+")


class Normalizer(Protocol):
    """What TextNormalizer needs of a text normalizer (wetext's `Normalizer`)."""

    def normalize(self, text: str) -> str: ...


@functools.cache
def wetext_normalizers() -> tuple[Normalizer, Normalizer]:
    """(Chinese, English) wetext normalizers. wetext loads its FSTs once, on import (here: when the first
    TextNormalizer is made, i.e. at model load); these objects only hold options."""
    from wetext import Normalizer as WetextNormalizer

    return (WetextNormalizer(lang="zh", operator="tn", remove_erhua=False),
            WetextNormalizer(lang="en", operator="tn"))


_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ("", "thousand", "million", "billion", "trillion", "quadrillion", "quintillion",
           "sextillion", "septillion", "octillion", "nonillion", "decillion")


def contains_chinese(text: str) -> bool:
    return _CJK.search(text) is not None


def is_only_punctuation(text: str) -> bool:
    """True for text made only of Unicode punctuation (P*) and symbols (S*), and for ''."""
    return all(unicodedata.category(ch)[0] in "PS" for ch in text)


def _below_thousand(n: int) -> str:
    """Words for 0 < n < 1000: 'three hundred and forty-two'."""
    hundreds, rest = divmod(n, 100)
    if rest < 20:
        rest_words = _ONES[rest] if rest else ""
    else:
        tens, ones = divmod(rest, 10)
        rest_words = _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
    if not hundreds:
        return rest_words
    return f"{_ONES[hundreds]} hundred" + (f" and {rest_words}" if rest_words else "")


def spell_out_integer(digits: str) -> str:
    """English words for a run of digits, worded like inflect's `number_to_words`.

    Groups of three are joined by ', ', except that a last group below 100 is joined by ' and '.
    Numbers past the decillions are read digit by digit.
    """
    value = int(digits)
    if value == 0:
        return _ONES[0]
    groups = []  # (group value, scale index), most significant first
    scale = 0
    while value:
        value, group = divmod(value, 1000)
        groups.append((group, scale))
        scale += 1
    if scale > len(_SCALES):
        return " ".join(_ONES[int(d)] for d in digits)
    groups = [(g, s) for g, s in reversed(groups) if g]
    words = [_below_thousand(g) + (f" {_SCALES[s]}" if s else "") for g, s in groups]
    if len(words) > 1 and groups[-1][1] == 0 and groups[-1][0] < 100:
        return ", ".join(words[:-1]) + " and " + words[-1]
    return ", ".join(words)


def spell_out_numbers(text: str) -> str:
    """Replace every run of ASCII or Unicode digits by its English words."""
    return _DIGIT_RUN.sub(lambda m: spell_out_integer(m.group()), text)


def remove_blanks_in_chinese(text: str) -> str:
    """Drop every space unless both neighbours are ASCII non-space characters ('a b' keeps it)."""
    kept = []
    for i, ch in enumerate(text):
        if ch == " ":
            before = text[i - 1] if i > 0 else " "
            after = text[i + 1] if i + 1 < len(text) else " "
            if not (before.isascii() and before != " " and after.isascii() and after != " "):
                continue
        kept.append(ch)
    return "".join(kept)


def clean_chinese(text: str) -> str:
    """The clean-ups the official frontend applies to Chinese text after wetext."""
    text = text.replace("\n", "")
    text = remove_blanks_in_chinese(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for bracket in ("（", "）", "【", "】", "`"):
        text = text.replace(bracket, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS.sub("。", text)


def cut_at_punctuation(text: str, marks: frozenset[str]) -> list[str]:
    """Cut after every sentence mark; a closing quote right after a mark stays with its piece.

    A mark that would end an empty piece (the second of '。。') is dropped, as in the official code.
    """
    pieces: list[str] = []
    start = 0
    for i, ch in enumerate(text):
        if ch not in marks:
            continue
        if i > start:
            pieces.append(text[start:i + 1])
        start = i + 1
        if start < len(text) and text[start] in CLOSING_QUOTES and pieces:
            pieces[-1] += text[start]
            start += 1
    return pieces


def merge_pieces(pieces: list[str], length: Callable[[str], int], max_n: int = TOKEN_MAX_N,
                 min_n: int = TOKEN_MIN_N, merge_len: int = MERGE_LEN) -> list[str]:
    """Greedily join pieces into sentences of about `min_n`..`max_n` units of `length`."""
    sentences: list[str] = []
    current = ""
    for piece in pieces:
        if length(current + piece) > max_n and length(current) > min_n:
            sentences.append(current)
            current = ""
        current += piece
    if current:
        if sentences and length(current) < merge_len:
            sentences[-1] += current
        else:
            sentences.append(current)
    return sentences


def split_paragraph(text: str, count_tokens: Callable[[str], int], chinese: bool) -> list[str]:
    """Sentences of `text`, cut at sentence marks (never at commas); Chinese lengths are
    characters, other lengths are tokens."""
    if not text:
        return []
    marks = ZH_SENTENCE_MARKS if chinese else EN_SENTENCE_MARKS
    if text[-1] not in marks:
        text += "。" if chinese else "."
    length = len if chinese else count_tokens
    return merge_pieces(cut_at_punctuation(text, marks), length)


def _normalize_piece(piece: str, normalize: Callable[[str], str]) -> str:
    """`normalize` on the words of `piece`, its leading and trailing white space kept (none: wetext fails on
    empty text)."""
    words = piece.strip()
    if not words:
        return piece
    lead, trail = piece[:len(piece) - len(piece.lstrip())], piece[len(piece.rstrip()):]
    return lead + normalize(words) + trail


def is_markup(text: str) -> bool:
    """SSML-like `<|...|>` text skips normalization."""
    return "<|" in text and "|>" in text


class TextNormalizer:
    """Normalizes and splits request text. `count_tokens` measures English sentence lengths; `verbatim` are
    tokens passed through untouched (the family's `verbatim_tokens`)."""

    def __init__(self, count_tokens: Callable[[str], int],
                 normalizers: tuple[Normalizer, Normalizer] | None = None, verbatim: tuple[str, ...] = ()):
        self.count_tokens = count_tokens
        self.zh, self.en = normalizers or wetext_normalizers()  # (Chinese, English)
        # Longest first, so that `[AA0]` is not read as `[AA]` then `0]`.
        self._verbatim = re.compile("|".join(map(re.escape, sorted(verbatim, key=len, reverse=True)))) \
            if verbatim else None

    def _normalize(self, text: str, lang: str | None = None) -> tuple[str, bool]:
        """(normalized text, whether it is Chinese): in `lang` ("zh" or "en", an SSML language hint), else in
        the language the text looks like (Chinese characters or not, as the official frontend decides)."""
        text = text.strip()
        chinese = lang == "zh" if lang else contains_chinese(text)
        if chinese:
            return clean_chinese(self._around_verbatim(text, self.zh.normalize)), True
        return self._around_verbatim(text, lambda piece: spell_out_numbers(self.en.normalize(piece))), False

    def _around_verbatim(self, text: str, normalize: Callable[[str], str]) -> str:
        """`normalize` on the text between verbatim tokens, which stay as they are (as does the white space
        around each piece, which wetext would trim)."""
        if self._verbatim is None or not self._verbatim.search(text):
            return normalize(text)
        out, start = [], 0
        for match in self._verbatim.finditer(text):
            out += [_normalize_piece(text[start:match.start()], normalize), match.group()]
            start = match.end()
        return "".join(out + [_normalize_piece(text[start:], normalize)])

    def normalize(self, text: str) -> str:
        """The whole text normalized, unsplit (the official `split=False`; used for prompt text)."""
        if is_markup(text) or not text:
            return text
        return self._normalize(text)[0]

    def split(self, text: str, lang: str | None = None) -> list[str]:
        """Normalized sentences to synthesize one by one, punctuation-only pieces dropped (`lang` as
        `_normalize`)."""
        if is_markup(text) or not text:
            return [text]
        normalized, chinese = self._normalize(text, lang)
        sentences = split_paragraph(normalized, self.count_tokens, chinese)
        return [s for s in sentences if not is_only_punctuation(s)]


class TextPreprocessor:
    """Request text in, sentences out: validation, normalization, splitting, the tokenizer, and the family whose
    text forms the pipeline lays out."""

    def __init__(self, tokenizer: TextTokenizer, max_chars: int = DEFAULT_MAX_CHARS,
                 normalizers: tuple[Normalizer, Normalizer] | None = None, family: ModelFamily = COSYVOICE2):
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.family = family
        # normalizers: wetext's by default
        self.normalizer = TextNormalizer(tokenizer.count, normalizers, family.verbatim_tokens)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, max_chars: int = DEFAULT_MAX_CHARS,
                       normalizers: tuple[Normalizer, Normalizer] | None = None) -> TextPreprocessor:
        """The folder's tokenizer with its family's special tokens, and that family."""
        paths = ModelPaths(Path(model_dir))
        family = paths.family
        return cls(TextTokenizer.from_dir(paths.qwen_dir, family.special_tokens), max_chars=max_chars,
                   normalizers=normalizers, family=family)

    def split(self, text: str, field: str = "text", lang: str | None = None) -> list[str]:
        """The normalized sentences of `text`, checked where the request entered the process
        (wire/checks.py `validate_text`), in `lang` ("zh" or "en"; None: detected); errors name `field`."""
        sentences = self.normalizer.split(text, lang)
        if not sentences:
            raise InvalidInput(field, "has nothing to speak (only punctuation or symbols)")
        return sentences

    def normalize(self, text: str) -> str:
        """The whole text normalized, unsplit (for prompt and instruction text)."""
        return self.normalizer.normalize(text)
