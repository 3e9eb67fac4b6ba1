"""The seeds every path derives from a synthesis request (`messages.SynthesisRequest`)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from ..messages import SEED_LIMIT


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
