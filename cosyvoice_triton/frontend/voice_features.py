"""What a registered voice is: the features computed once from its recording, and the recording's hash.

numpy only (no torch, no ONNX Runtime), so the voice stores and the gateway can use it without loading
the models; `frontend/prompt.py` computes the features.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptFeatures:
    """Everything a voice needs at synthesis time; computed once per recording."""

    embedding: np.ndarray  # (192,) float32
    speech_tokens: np.ndarray  # (N,) int32, values in [0, 6561)
    mel: np.ndarray  # (token_mel_ratio * N, 80) float32
    text: str  # the prompt transcript as given
    audio_sha256: str  # `audio_sha256` of the recording


def audio_sha256(samples: np.ndarray, sample_rate: int) -> str:
    """Hex digest of the sample rate (uint32 LE) followed by the float32 LE samples."""
    digest = hashlib.sha256(np.uint32(sample_rate).astype("<u4").tobytes())
    digest.update(np.ascontiguousarray(samples, dtype="<f4").tobytes())
    return digest.hexdigest()
