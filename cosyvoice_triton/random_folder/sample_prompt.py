"""A speech-like prompt recording made locally (no downloads): voiced syllables with formants.

Used for tests and for the `default` voice of a fresh install. A glottal pulse train with a
wandering pitch goes through three formant resonators that move from vowel to vowel, with short
noisy consonant bursts and pauses between syllables.
"""
from __future__ import annotations

import numpy as np
from scipy.signal import lfilter

VOWEL_FORMANTS_HZ = [(730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480), (570, 840, 2410)]


def _resonator(x: np.ndarray, freq: float, bandwidth: float, rate: int) -> np.ndarray:
    r = np.exp(-np.pi * bandwidth / rate)
    a = [1.0, -2 * r * np.cos(2 * np.pi * freq / rate), r * r]
    return lfilter([1 - r], a, x)


def speech_like(seconds: float = 3.0, rate: int = 16000, seed: int = 0, pitch_hz: float = 120.0) -> np.ndarray:
    """Mono float32 in [-1, 1], `seconds` long at `rate` Hz."""
    rng = np.random.default_rng(seed)
    out = np.zeros(int(seconds * rate), dtype=np.float64)
    pos = int(0.1 * rate)
    while pos < out.size - int(0.15 * rate):
        syllable = int(rng.uniform(0.15, 0.3) * rate)
        n = min(syllable, out.size - pos)
        t = np.arange(n) / rate
        f0 = pitch_hz * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(1, 3) * t + rng.uniform(0, 6)))
        phase = np.cumsum(f0 / rate)
        pulses = (np.diff(np.floor(phase), prepend=0) > 0).astype(np.float64)
        voiced = sum(_resonator(pulses, f, 60 + 0.05 * f, rate) for f in VOWEL_FORMANTS_HZ[rng.integers(5)])
        burst = rng.normal(0, 0.3, n) * np.exp(-t / 0.02)  # a consonant onset
        envelope = np.sin(np.pi * np.arange(n) / n) ** 0.5
        out[pos:pos + n] += (voiced / (np.abs(voiced).max() + 1e-9) + burst) * envelope
        pos += n + int(rng.uniform(0.03, 0.12) * rate)
    return (0.5 * out / (np.abs(out).max() + 1e-9)).astype(np.float32)
