"""The messages that cross module boundaries, on one page: open this file first.

A synthesis request (`SynthesisRequest`) is checked once, split into sentences; each sentence is an
`LLMRequest` to the speech LM, whose tokens go in chunks (`ChunkRequest`) to token2wav with the voice's
`FlowPrompt`. A voice's `PromptFeatures` are computed once from its prompt (recording + transcript).
A `ConversionRequest` (voice conversion) skips the LLM: its source recording's speech tokens go to token2wav.

Constants every route checks against: `MODES`, the seed range [0, SEED_LIMIT) and the speed range
[MIN_SPEED, MAX_SPEED] (OpenAI's 0.25 .. 4.0). Seeds are unsigned
64-bit: the Triton `seed` tensors are UINT64 and `torch.Generator.manual_seed` takes any of them, so the
gateway, the Triton models and the in-process path all accept the same range.

numpy and the library's errors only (torch only in annotations): the gateway and the voice stores
import this without loading torch. Triton tensor names are mapped in `wire/names.py`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from cosyvoice_triton.errors import InvalidInput

if TYPE_CHECKING:
    import torch

MODES = ("zero_shot", "cross_lingual", "instruct2")
VC_MODE = "vc"  # voice conversion: a source recording spoken again in a voice (no text, no LLM)
SEED_LIMIT = 2**64  # seeds are integers in [0, SEED_LIMIT): UINT64 on the wire, torch.Generator's range
MIN_HOP_TOKENS = 4  # the vocoder holds back 8 mel frames (4 tokens) of every non-final chunk
TEXT_TYPES = ("text", "ssml")  # a request's text_type; None: "ssml" when the text starts with <speak (preprocess/ssml.py)
TEXT_MODES = ("sentences", "bistream")  # sentences: one LLM stream per sentence; bistream: text fed as it arrives
CHUNK_POLICIES = ("fixed", "adaptive")  # ChunkPolicy.kind; see pipeline/chunk_policy.py
MIN_SPEED, MAX_SPEED = 0.25, 4.0  # speaking speed: the mel interpolated by 1 / speed (token2wav/speed.py)
SAMPLE_RATE = 24000  # Hz: CosyVoice2 speaks at 24 kHz, mono (token2wav's output)
SPEECH_TOKENS_PER_SECOND = 25  # speech tokens per second of audio (the S3 tokenizer's and the LLM's rate)


def is_int(value: object) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_seed(seed: object, field_name: str = "seed") -> int:
    """`seed` if it is an integer in [0, SEED_LIMIT); InvalidInput naming `field_name` otherwise."""
    if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise InvalidInput(field_name, f"must be an integer in [0, 2**64), got {seed!r}")
    return seed


def check_mode(mode: object, instruct_text: str) -> str:
    """`mode` if it is one of MODES and, in instruct2, comes with an instruction; InvalidInput naming `mode`
    or `instruct_text` otherwise."""
    if mode not in MODES:
        raise InvalidInput("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "instruct2" and not instruct_text.strip():
        raise InvalidInput("instruct_text", "is required in instruct2 mode")
    return mode


def check_text_type(text_type: object, field_name: str = "text_type") -> None:
    """None (decided by the text) or one of TEXT_TYPES; InvalidInput naming `field_name` otherwise."""
    if text_type is not None and text_type not in TEXT_TYPES:
        raise InvalidInput(field_name, f"must be one of {', '.join(TEXT_TYPES)}, got {text_type!r}")


def voice_modes(prompt_text: str) -> tuple[str, ...]:
    """The modes a voice with this prompt transcript can serve: zero_shot needs the transcript; cross_lingual,
    instruct2 and voice conversion use only the recording's features."""
    return tuple(mode for mode in (*MODES, VC_MODE) if mode != "zero_shot" or prompt_text.strip())


def check_voice_serves(mode: str, voice: PromptFeatures) -> None:
    """InvalidInput naming reference_text when `mode` needs a transcript that `voice` lacks (known only once the
    voice is resolved, so it is checked then, not at the parse)."""
    if mode not in voice_modes(voice.text):
        raise InvalidInput("reference_text", "is required in zero_shot mode (the transcript of the voice prompt)")


def check_speed(speed: object, field_name: str = "speed") -> float:
    """`speed` if it is a number in [MIN_SPEED, MAX_SPEED]; InvalidInput naming `field_name` otherwise."""
    if not is_real(speed) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise InvalidInput(field_name, f"must be a number from {MIN_SPEED} to {MAX_SPEED}, got {speed!r}")
    return speed


# ---- settings a request may override ----------------------------------------------------------------

@dataclass(frozen=True)
class SamplingParams:
    """Repetition-aware sampling settings; the defaults are the released `cosyvoice2.yaml` values."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    seed: int | None = None

    def validate(self) -> SamplingParams:
        """Raise InvalidInput naming the first out-of-range field; return self."""
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidInput("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 1:
            raise InvalidInput("top_k", f"must be an integer >= 1, got {self.top_k!r}")
        if not is_int(self.win_size) or self.win_size < 1:
            raise InvalidInput("win_size", f"must be an integer >= 1, got {self.win_size!r}")
        if not is_real(self.tau_r) or self.tau_r < 0.0:
            raise InvalidInput("tau_r", f"must be a finite number >= 0, got {self.tau_r!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise InvalidInput("seed", f"must be null or an integer in [0, 2**64), got {self.seed!r}")
        return self

    @classmethod
    def from_llm_yaml(cls, llm: dict) -> SamplingParams:
        """The folder's settings: `cosyvoice2.yaml`'s `llm.sampling` (its other keys are not sampling settings)."""
        keys = ("top_p", "top_k", "win_size", "tau_r")
        return cls(**{k: v for k, v in llm["sampling"].items() if k in keys}).validate()


@dataclass(frozen=True)
class ChunkPolicy:
    """When a stream's tokens become audio (see `pipeline/chunk_policy.py` for the schedule)."""

    first_hop: int = 25  # tokens in the first chunk, before the prompt alignment pad
    hop_scale: float = 2.0  # each later hop is the previous one times this
    max_hop: int = 100  # hops never grow beyond this many tokens
    lookahead: int = 3  # right-context tokens the flow's pre-lookahead layer needs
    align_to_chunk: bool = True  # pad the first hop so it ends on a flow attention chunk boundary
    chunk_tokens: int = 25  # the flow's attention chunk, in tokens (yaml: chunk_size)
    kind: str = "fixed"  # fixed: the official schedule; adaptive: hops follow the listener's lead

    def validate(self) -> ChunkPolicy:
        if self.kind not in CHUNK_POLICIES:
            raise InvalidInput("chunk_policy", f"must be one of {', '.join(CHUNK_POLICIES)}, got {self.kind!r}")
        if self.first_hop < MIN_HOP_TOKENS:
            raise InvalidInput("chunk_first_hop", f"must be >= {MIN_HOP_TOKENS}, got {self.first_hop}")
        if not 1.0 <= self.hop_scale <= 16.0:
            raise InvalidInput("chunk_hop_scale", f"must be in [1, 16], got {self.hop_scale}")
        if self.max_hop < self.first_hop:
            raise InvalidInput("chunk_max_hop", f"must be >= first hop {self.first_hop}, got {self.max_hop}")
        if self.lookahead < 0:
            raise InvalidInput("chunk_lookahead", f"must be >= 0, got {self.lookahead}")
        return self

    def with_overrides(self, **overrides) -> ChunkPolicy:
        """A copy with per-request overrides (None values are ignored), validated."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **given).validate()


# ---- a voice ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PromptFeatures:
    """Everything a voice needs at synthesis time; computed once per prompt recording."""

    embedding: np.ndarray  # (192,) float32
    speech_tokens: np.ndarray  # (N,) int32, values in [0, 6561)
    mel: np.ndarray  # (token_mel_ratio * N, 80) float32
    text: str  # the prompt transcript as given
    audio_sha256: str  # `preprocess.voice_features.audio_sha256` of the recording


@dataclass
class FlowPrompt:
    """The flow-side prompt of a voice, as token2wav takes it: numpy arrays from the voice to the wire;
    token2wav turns them into torch tensors once, when a stream opens (`token2wav.stream.prompt_tensors`;
    torch tensors are taken as they are)."""

    speech_tokens: np.ndarray | torch.Tensor  # (1, P) int32
    mel: np.ndarray | torch.Tensor  # (1, 2P, 80) float32
    embedding: np.ndarray | torch.Tensor  # (1, 192) float32


# ---- requests -----------------------------------------------------------------------------------------

@dataclass
class SynthesisRequest:
    """One text to speak in one voice."""

    text: str
    voice: PromptFeatures
    mode: str = "zero_shot"
    instruct_text: str = ""
    seed: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chunk_policy: ChunkPolicy = field(default_factory=ChunkPolicy)
    text_frontend: bool = True  # False: the text as given: no normalization, no sentence splitting (official text_frontend=False)
    speed: float = 1.0  # speaking speed in [MIN_SPEED, MAX_SPEED]: the mel interpolated by 1 / speed
    text_type: str | None = None  # text | ssml (preprocess/ssml.py); None: ssml when the text starts with <speak
    voice_of: Callable[[str], PromptFeatures] | None = None  # SSML <voice name>: a voice id -> its features
    marks: bool = False  # speech marks among the audio chunks (pipeline/speech_marks.py)

    def validate(self) -> SynthesisRequest:
        check_text_type(self.text_type)
        check_mode(self.mode, self.instruct_text)
        check_voice_serves(self.mode, self.voice)
        if self.seed is not None:
            check_seed(self.seed)
        check_speed(self.speed)
        self.sampling.validate()
        self.chunk_policy.validate()
        return self


@dataclass
class ConversionRequest:
    """One source recording to speak again in one voice (voice conversion, the official inference_vc)."""

    source: np.ndarray  # (N,) float32 mono samples at `sample_rate`
    sample_rate: int
    voice: PromptFeatures  # the target voice: only its flow side (tokens, mel, embedding) is used
    seed: int | None = None
    chunk_policy: ChunkPolicy = field(default_factory=ChunkPolicy)
    speed: float = 1.0  # speaking speed in [MIN_SPEED, MAX_SPEED], as the official inference_vc's

    def validate(self) -> ConversionRequest:
        if self.seed is not None:
            check_seed(self.seed)
        check_speed(self.speed)
        self.chunk_policy.validate()
        return self


@dataclass(frozen=True)
class LLMRequest:
    """One sentence for the speech LM."""

    stream_id: str
    text_tokens: list[int]  # the sentence to speak
    prompt_text_tokens: list[int]  # empty in cross_lingual; instruction tokens in instruct2
    prompt_speech_tokens: list[int]  # empty outside zero_shot
    sampling: SamplingParams  # its `seed` is ignored: `seed` below seeds the stream
    seed: int
    bistream: bool = False  # text_tokens are only the first text: more is appended to the live stream
    # Seconds of audio its listener still has to play when this sentence is asked for (a later sentence of a
    # stream that plays); None: nobody listens yet. The LLM gives a free slot to the least lead first.
    lead_s: float | None = None


@dataclass
class ChunkRequest:
    """The next piece of one token2wav stream."""

    stream_id: str
    tokens: list[int]  # new speech tokens since this stream's previous request (may be empty on a final call)
    finalize: bool  # last chunk of the stream: emit everything, then free the state
    prompt: FlowPrompt | None  # required on the first request of a stream, ignored afterwards
    seed: int | None  # vocoder noise seed, used on the first request (None -> random)
    speed: float = 1.0  # speaking speed of the stream, used on the first request (token2wav/speed.py)
