"""What one synthesis request asks for, and the seeds every path derives from it."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from ..errors import InvalidInput
from ..frontend.voice_features import PromptFeatures
from .chunk_policy import ChunkPolicy
from .request_limits import MODES, SEED_LIMIT
from .sampling import SamplingParams

END_OF_PROMPT = "<|endofprompt|>"


@dataclass
class SynthesisRequest:
    text: str
    voice: PromptFeatures
    mode: str = "zero_shot"
    instruct_text: str = ""
    seed: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chunk_policy: ChunkPolicy = field(default_factory=ChunkPolicy)

    def validate(self) -> "SynthesisRequest":
        if self.mode not in MODES:
            raise InvalidInput("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "instruct2" and not self.instruct_text.strip():
            raise InvalidInput("instruct_text", "is required in instruct2 mode")
        if self.mode == "zero_shot" and not self.voice.text.strip():
            raise InvalidInput("reference_text", "is required in zero_shot mode (the transcript of the voice prompt)")
        self.sampling.validate()
        self.chunk_policy.validate()
        return self


@dataclass(frozen=True)
class SentenceSeeds:
    llm: int  # speech-token sampling
    vocoder: int  # HiFT's sine phase and noise


def sentence_seeds(seed: int, index: int) -> SentenceSeeds:
    """Seeds of sentence `index` of a request: every process that runs a sentence derives the same ones,
    so a request gives the same audio in-process, on one Triton server or split across several."""
    base = (seed + 2 * index) % SEED_LIMIT
    return SentenceSeeds(llm=base, vocoder=(base + 1) % SEED_LIMIT)


def random_seed() -> int:
    """A fresh seed for a request that gave none (from the OS: independent of any torch RNG state)."""
    return secrets.randbelow(SEED_LIMIT)
