"""A folder of recordings + transcripts -> training examples with features, computed once and cached.

Two layouts of DIR are read (paths relative to DIR, or absolute):
- `metadata.csv`: one `file|text` line per recording (LJSpeech style; no header; `#` lines are comments);
- Kaldi style: `wav.scp` (`utt_id path`) and `text` (`utt_id transcript`).

For each recording the prompt encoder of the base model folder (`preprocess/prompt.py`) computes the
speaker embedding (CAM++), the speech tokens (the family's S3 tokenizer: speech_tokenizer_v2.onnx for
CosyVoice2, speech_tokenizer_v3.onnx for CosyVoice3) and the 24 kHz mel, aligned as at synthesis. The
transcript is tokenized with the family's special tokens; CosyVoice3's recipe reads an instruct before it
(`instruct_tokens`).
They are cached as `<cache_dir>/<key>.npz`, the key being the sha256 of the audio file's bytes and of
the feature model (both ONNX files and the mel parameters), so a second run, or a run on another base
folder with the same feature models, computes nothing again. A recording that is missing, cannot be
decoded, is shorter than 0.5 s or longer than 30 s, is silent, or has an empty transcript is skipped and
reported with its name and the reason.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cosyvoice_triton.config import ModelPaths, read_yaml
from cosyvoice_triton.errors import DataError, InvalidInput
from cosyvoice_triton.family import ModelFamily
from cosyvoice_triton.preprocess.audio import decode_audio
from cosyvoice_triton.preprocess.prompt import PromptEncoder
from cosyvoice_triton.preprocess.tokenizer import TextTokenizer

METADATA = "metadata.csv"
KALDI_WAV_SCP = "wav.scp"
KALDI_TEXT = "text"
HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class Utterance:
    name: str  # as the manifest names it (file path or utt_id): what reports show
    audio_path: Path
    text: str


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


@dataclass(frozen=True)
class Example:
    """One prepared recording."""

    name: str
    instruct_token: np.ndarray  # (Ni,) int64: the family's instruct (`instruct_tokens`), empty for CosyVoice2
    text_token: np.ndarray  # (Nt,) int64: the transcript
    speech_token: np.ndarray  # (N,) int64, 25 Hz
    speech_feat: np.ndarray  # (token_mel_ratio * N, 80) float32, 50 Hz
    embedding: np.ndarray  # (192,) float32


def _read_lines(path: Path) -> list[tuple[int, str]]:
    lines = path.read_text(encoding="utf-8-sig").splitlines()
    return [(n, line.strip()) for n, line in enumerate(lines, 1) if line.strip() and not line.startswith("#")]


def _resolve(data_dir: Path, file: str) -> Path:
    path = Path(file)
    return path if path.is_absolute() else data_dir / path


def read_metadata_csv(data_dir: Path) -> tuple[list[Utterance], list[Skipped]]:
    utterances, skipped = [], []
    for n, line in _read_lines(data_dir / METADATA):
        file, sep, text = line.partition("|")
        if not sep:
            skipped.append(Skipped(f"{METADATA} line {n}", "no '|' between file and text"))
            continue
        utterances.append(Utterance(file.strip(), _resolve(data_dir, file.strip()), text.strip()))
    return utterances, skipped


def read_kaldi(data_dir: Path) -> tuple[list[Utterance], list[Skipped]]:
    texts = {}
    for _, line in _read_lines(data_dir / KALDI_TEXT):
        utt_id, _, text = line.partition(" ")
        texts[utt_id] = text.strip()
    utterances, skipped = [], []
    for n, line in _read_lines(data_dir / KALDI_WAV_SCP):
        utt_id, _, file = line.partition(" ")
        if not file.strip():
            skipped.append(Skipped(f"{KALDI_WAV_SCP} line {n}", "no path after the utterance id"))
        elif utt_id not in texts:
            skipped.append(Skipped(utt_id, f"no transcript in {KALDI_TEXT}"))
        else:
            utterances.append(Utterance(utt_id, _resolve(data_dir, file.strip()), texts[utt_id]))
    return utterances, skipped


def read_manifest(data_dir: str | Path) -> tuple[list[Utterance], list[Skipped]]:
    """The utterances of DIR (metadata.csv, else wav.scp + text) and the manifest lines that are unusable."""
    data_dir = Path(data_dir)
    if (data_dir / METADATA).exists():
        return read_metadata_csv(data_dir)
    if (data_dir / KALDI_WAV_SCP).exists() and (data_dir / KALDI_TEXT).exists():
        return read_kaldi(data_dir)
    raise DataError(f"{data_dir} holds neither {METADATA} (file|text) nor {KALDI_WAV_SCP} + {KALDI_TEXT}")


def _sha256_file(path: Path, digest=None):
    digest = digest or hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest


def instruct_tokens(tokenizer: TextTokenizer, family: ModelFamily) -> list[int]:
    """What the LM reads before every transcript in training. The CosyVoice3 recipe gives each recording an
    instruct, the system prompt ending in `<|endofprompt|>` (the family's `prompt_prefix`), tokenized apart
    from the transcript; CosyVoice2 has none."""
    return tokenizer.encode(family.prompt_prefix) if family.prompt_prefix else []


def feature_model_fingerprint(model_dir: Path) -> str:
    """sha256 of what the features depend on: both ONNX models and the mel parameters."""
    paths = ModelPaths(model_dir)
    digest = hashlib.sha256()
    for path in (paths.campplus, paths.speech_tokenizer):
        digest.update(_sha256_file(path).digest())
    config = read_yaml(paths.yaml)
    digest.update(repr((config.get("feat_extractor"), config.get("token_mel_ratio"))).encode())
    return digest.hexdigest()


class FeatureCache:
    """`<root>/<sha256(audio bytes, feature model)>.npz` holding embedding, speech tokens and mel."""

    def __init__(self, root: Path, fingerprint: str):
        self.root = root
        self.fingerprint = fingerprint
        root.mkdir(parents=True, exist_ok=True)

    def key(self, audio: bytes) -> str:
        return hashlib.sha256(self.fingerprint.encode() + hashlib.sha256(audio).digest()).hexdigest()

    def load(self, key: str) -> dict[str, np.ndarray] | None:
        path = self.root / f"{key}.npz"
        if not path.exists():
            return None
        with np.load(path) as data:
            return {name: data[name] for name in data.files}

    def store(self, key: str, features: dict[str, np.ndarray]) -> None:
        tmp = self.root / f"{key}.tmp.npz"
        np.savez(tmp, **features)
        tmp.replace(self.root / f"{key}.npz")


def _features(encoder: PromptEncoder, audio: bytes, text: str, field: str) -> dict[str, np.ndarray]:
    samples, rate = decode_audio(audio, field)
    prompt = encoder.encode(samples, rate, text, field=field)  # checks length and silence
    if prompt.speech_tokens.size == 0:
        raise InvalidInput(field, "gives no speech tokens")
    return {"embedding": prompt.embedding, "speech_token": prompt.speech_tokens, "speech_feat": prompt.mel}


def prepare_examples(utterances: list[Utterance], model_dir: Path, cache_dir: Path,
                     progress: bool = True) -> tuple[list[Example], list[Skipped]]:
    """Features of every usable utterance (from the cache where present) and the skipped ones."""
    paths = ModelPaths(model_dir)
    family = paths.family
    tokenizer = TextTokenizer.from_dir(paths.qwen_dir, family.special_tokens)
    instruct = instruct_tokens(tokenizer, family)
    cache = FeatureCache(cache_dir, feature_model_fingerprint(paths.root))
    encoder: PromptEncoder | None = None  # opened on the first cache miss
    examples, skipped = [], []
    for utt in tqdm(utterances, desc="preparing features", unit="file", disable=not progress, file=sys.stderr):
        if not utt.text:
            skipped.append(Skipped(utt.name, "empty transcript"))
            continue
        words = tokenizer.encode(utt.text)
        if not words:
            skipped.append(Skipped(utt.name, "transcript gives no text tokens"))
            continue
        if not utt.audio_path.is_file():
            skipped.append(Skipped(utt.name, f"file not found: {utt.audio_path}"))
            continue
        audio = utt.audio_path.read_bytes()
        key = cache.key(audio)
        features = cache.load(key)
        if features is None:
            encoder = encoder or PromptEncoder.from_model_dir(paths.root, device="cpu")
            try:
                features = _features(encoder, audio, utt.text, field=utt.name)
            except InvalidInput as error:
                skipped.append(Skipped(utt.name, error.problem))
                continue
            cache.store(key, features)
        examples.append(Example(name=utt.name, instruct_token=np.asarray(instruct, dtype=np.int64),
                                text_token=np.asarray(words, dtype=np.int64),
                                speech_token=features["speech_token"].astype(np.int64),
                                speech_feat=features["speech_feat"].astype(np.float32),
                                embedding=features["embedding"].astype(np.float32)))
    return examples, skipped


def report_skipped(skipped: list[Skipped], total: int, out=sys.stderr) -> None:
    if skipped:
        print(f"skipped {len(skipped)} of {total} recordings:", file=out)
        for item in skipped:
            print(f"  {item.name}: {item.reason}", file=out)
