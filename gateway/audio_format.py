"""Audio on the wire: float32 chunks from Triton -> PCM bytes or WAV.

Formats (24 kHz mono):
  pcm_f32     raw little-endian float32 samples, as the model makes them
  pcm_s16le   raw little-endian 16-bit samples (clipped to [-1, 1], scaled by 32767, rounded)
  wav         a WAV file of 16-bit samples. Streamed, its header comes first and gives both sizes as
              0xFFFFFFFF ("unknown length", as ffmpeg and most players accept); not streamed, the
              exact sizes.
"""
from __future__ import annotations

import struct

import numpy as np

FORMATS = ("wav", "pcm_f32", "pcm_s16le")
CONTENT_TYPES = {"wav": "audio/wav", "pcm_f32": "audio/L32", "pcm_s16le": "audio/L16"}
UNKNOWN_SIZE = 0xFFFFFFFF


def to_s16(samples: np.ndarray) -> np.ndarray:
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")


def pcm_bytes(samples: np.ndarray, fmt: str) -> bytes:
    """Samples (N,) float32 -> raw bytes of `fmt` (a wav stream carries 16-bit PCM after its header)."""
    if fmt == "pcm_f32":
        return np.asarray(samples, dtype="<f4").tobytes()
    return to_s16(np.asarray(samples, dtype=np.float32)).tobytes()


def wav_header(sample_rate: int, data_bytes: int | None, bits: int = 16, channels: int = 1) -> bytes:
    """A 44-byte PCM WAV header; `data_bytes` None: unknown length (streaming)."""
    block = channels * bits // 8
    riff_size = UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    data_size = UNKNOWN_SIZE if data_bytes is None else data_bytes
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
            + b"data" + struct.pack("<I", data_size))


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    data = to_s16(np.asarray(samples, dtype=np.float32)).tobytes()
    return wav_header(sample_rate, len(data)) + data


def bytes_per_sample(fmt: str) -> int:
    return 4 if fmt == "pcm_f32" else 2
