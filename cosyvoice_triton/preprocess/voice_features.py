"""The hash that identifies a voice's prompt recording (its features are `messages.PromptFeatures`).

numpy only (no torch, no ONNX Runtime), so the voice stores and the gateway can use it without loading
the models; `preprocess/prompt.py` computes the features.
"""
from __future__ import annotations

import hashlib

import numpy as np


def audio_sha256(samples: np.ndarray, sample_rate: int) -> str:
    """Hex digest of the sample rate (uint32 LE) followed by the float32 LE samples."""
    digest = hashlib.sha256(np.uint32(sample_rate).astype("<u4").tobytes())
    digest.update(np.ascontiguousarray(samples, dtype="<f4").tobytes())
    return digest.hexdigest()
