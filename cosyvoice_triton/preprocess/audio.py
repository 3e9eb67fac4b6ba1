"""Decode, check and resample reference audio.

A reference (prompt) recording arrives as file bytes (WAV, FLAC, OGG/Vorbis or anything else that
libsndfile reads) or as raw samples. It is mixed down to mono float32 and checked:

- every sample finite;
- at least `MIN_PROMPT_SECONDS` (0.5 s) and at most `MAX_PROMPT_SECONDS` (30 s, the limit of the
  S3 speech tokenizer);
- not silent: the RMS level must reach `SILENCE_RMS` (1e-4, i.e. -80 dBFS). Digital silence and
  16-bit dither noise (RMS about 2e-5) fail; quiet but real speech (RMS around 1e-2) passes.
- not white noise: the spectral flatness of its mean power spectrum (Welch, 512-sample frames) must stay
  below `NOISE_FLATNESS` (0.8). Random bytes after a WAV header decode as full-band noise (flatness about
  0.99); speech measures 0.05 to 0.3, tones far less.

Decoding errors name the field and say what was expected, never echo the decoder's message (which
names an internal buffer object).

Any sample rate is accepted and resampled (polyphase, Kaiser-windowed, deterministic).
"""
from __future__ import annotations

import io
from math import gcd

import numpy as np
from scipy.signal import resample_poly, welch

from cosyvoice_triton.errors import InvalidInput

MIN_PROMPT_SECONDS = 0.5
MAX_PROMPT_SECONDS = 30.0
SILENCE_RMS = 1e-4
NOISE_FLATNESS = 0.8
FLATNESS_FRAME = 512


def decode_audio(data: bytes, field: str) -> tuple[np.ndarray, int]:
    """(samples (N,) float32 mono in [-1, 1] for integer formats, sample rate) from file bytes."""
    if not data:
        raise InvalidInput(field, "is empty; expected WAV, FLAC or OGG audio")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInput(field, f"must be the bytes of an audio file, got {type(data).__name__}")
    import soundfile as sf  # here: only decoding file bytes needs libsndfile

    try:
        samples, sample_rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)  # (N, C)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, OverflowError, MemoryError):
        raise InvalidInput(field, f"could not be decoded as WAV, FLAC or OGG audio ({len(data)} bytes in a "
                                  "format libsndfile does not read, or damaged)") from None
    if samples.shape[0] == 0:
        raise InvalidInput(field, "contains no audio samples")
    return to_mono(samples), int(sample_rate)


def to_mono(samples: np.ndarray) -> np.ndarray:
    """(N,) or (N, C) → (N,) float32, channels averaged."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(samples)


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """(N,) at `from_rate` → (ceil(N * to_rate / from_rate),) float32 at `to_rate`."""
    if from_rate == to_rate:
        return np.asarray(samples, dtype=np.float32)
    divisor = gcd(from_rate, to_rate)
    out = resample_poly(np.asarray(samples, dtype=np.float64), to_rate // divisor, from_rate // divisor)
    return out.astype(np.float32)


def check_samples(samples: np.ndarray, sample_rate: int, field: str) -> float:
    """Raise InvalidInput (naming `field`) unless `samples` are mono (N,), finite, at a positive rate;
    return their length in seconds."""
    if samples.ndim != 1:
        raise InvalidInput(field, f"must be mono samples of shape (N,), got {samples.shape}")
    if sample_rate <= 0:
        raise InvalidInput(field, f"has an invalid sample rate {sample_rate}")
    if not np.all(np.isfinite(samples)):
        raise InvalidInput(field, "contains NaN or infinite samples")
    return samples.shape[0] / sample_rate


def validate_prompt_audio(samples: np.ndarray, sample_rate: int, field: str) -> None:
    """Raise InvalidInput (naming `field`) unless `samples` (N,) is a usable reference recording."""
    seconds = check_samples(samples, sample_rate, field)
    if seconds < MIN_PROMPT_SECONDS:
        raise InvalidInput(field, f"is {seconds:.2f} s long; at least {MIN_PROMPT_SECONDS} s is needed")
    if seconds > MAX_PROMPT_SECONDS:
        raise InvalidInput(field, f"is {seconds:.1f} s long; at most {MAX_PROMPT_SECONDS:g} s is supported")
    rms = float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))
    if rms < SILENCE_RMS:
        raise InvalidInput(field, f"is silent (RMS level {rms:.1e}, below {SILENCE_RMS:.0e})")
    flatness = spectral_flatness(samples)
    if flatness >= NOISE_FLATNESS:
        raise InvalidInput(field, f"is white noise, not a recording (spectral flatness {flatness:.2f}, "
                                  f"speech stays below {NOISE_FLATNESS}); is the file damaged?")


def spectral_flatness(samples: np.ndarray) -> float:
    """Geometric over arithmetic mean of the mean power spectrum of `samples` (N,) (DC left out):
    1 for white noise, near 0 for tones; speech about 0.05 to 0.3."""
    _, power = welch(samples.astype(np.float64), nperseg=min(FLATNESS_FRAME, samples.shape[0]))
    power = power[1:] + 1e-30
    return float(np.exp(np.mean(np.log(power))) / np.mean(power))


def load_prompt_audio(data: bytes, field: str) -> tuple[np.ndarray, int]:
    """Decode and check reference audio bytes: (samples (N,) float32, sample rate)."""
    samples, sample_rate = decode_audio(data, field)
    validate_prompt_audio(samples, sample_rate, field)
    return samples, sample_rate
