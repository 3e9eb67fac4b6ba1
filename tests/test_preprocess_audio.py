"""Decoding, resampling and checking reference audio."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.preprocess.audio import (decode_audio, load_prompt_audio, resample, to_mono,
                                             validate_prompt_audio)

FIELD = "reference_audio"


def tone(freq: float, seconds: float, rate: int, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


@pytest.mark.parametrize("fmt, subtype, rate, atol", [
    ("WAV", "PCM_16", 16000, 1e-4), ("WAV", "FLOAT", 44100, 0.0), ("FLAC", "PCM_16", 24000, 1e-4),
    ("OGG", "VORBIS", 22050, None),
])
def test_decode_formats(fmt: str, subtype: str, rate: int, atol: float | None) -> None:
    original = tone(440.0, 1.0, rate)
    samples, decoded_rate = decode_audio(encode(original, rate, fmt, subtype), FIELD)
    assert decoded_rate == rate
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert samples.shape == original.shape
    if atol is not None:
        np.testing.assert_allclose(samples, original, atol=atol)
    else:  # lossy: same pitch and level
        assert abs(peak_hz(samples, rate) - 440.0) < 2.0
        assert abs(np.std(samples) - np.std(original)) < 0.02


def test_decode_mixes_stereo_down() -> None:
    left, right = tone(300.0, 0.6, 16000), tone(300.0, 0.6, 16000, amplitude=0.1)
    samples, _ = decode_audio(encode(np.stack([left, right], axis=1), 16000, "WAV", "FLOAT"), FIELD)
    np.testing.assert_allclose(samples, (left + right) / 2, atol=1e-7)
    assert to_mono(np.stack([left, right], axis=1)).shape == left.shape


@pytest.mark.parametrize("data", [b"", b"definitely not audio", b"RIFF\x00\x00\x00\x00WAVEfmt junk", bytes(1000)])
def test_decode_rejects_non_audio(data: bytes) -> None:
    with pytest.raises(InvalidInput) as error:
        decode_audio(data, FIELD)
    assert error.value.field == FIELD


@pytest.mark.parametrize("from_rate, to_rate", [(44100, 16000), (44100, 24000), (8000, 16000), (8000, 24000),
                                                (48000, 24000), (16000, 24000)])
def test_resample_length_and_pitch(from_rate: int, to_rate: int) -> None:
    original = tone(500.0, 1.3, from_rate)
    out = resample(original, from_rate, to_rate)
    assert out.dtype == np.float32
    assert out.shape[0] == math.ceil(original.shape[0] * to_rate / from_rate)
    assert abs(peak_hz(out, to_rate) - 500.0) < 2.0
    middle = slice(len(out) // 4, 3 * len(out) // 4)
    np.testing.assert_allclose(np.abs(out[middle]).max(), 0.3, atol=0.01)
    np.testing.assert_array_equal(out, resample(original, from_rate, to_rate))  # deterministic


def test_resample_same_rate_is_identity() -> None:
    original = tone(500.0, 0.7, 16000)
    np.testing.assert_array_equal(resample(original, 16000, 16000), original)


def test_valid_prompt_passes_at_any_rate() -> None:
    for rate in (8000, 16000, 22050, 44100):
        validate_prompt_audio(tone(200.0, 0.5, rate), rate, FIELD)
    validate_prompt_audio(tone(200.0, 30.0, 16000), 16000, FIELD)
    validate_prompt_audio(tone(200.0, 1.0, 16000, amplitude=0.003), 16000, FIELD)  # quiet, not silent


def bad_samples() -> dict[str, tuple[np.ndarray, str]]:
    ok = tone(200.0, 1.0, 16000)
    with_nan, with_inf = ok.copy(), ok.copy()
    with_nan[100] = np.nan
    with_inf[5] = -np.inf
    dither = (np.random.default_rng(0).standard_normal(16000) * 2e-5).astype(np.float32)
    return {
        "nan": (with_nan, "NaN"), "inf": (with_inf, "infinite"),
        "zeros": (np.zeros(16000, np.float32), "silent"), "dither": (dither, "silent"),
        "short": (tone(200.0, 0.45, 16000), "at least 0.5 s"), "long": (tone(200.0, 30.5, 16000), "at most 30 s"),
        "stereo": (np.stack([ok, ok], axis=1), "mono"),
    }


@pytest.mark.parametrize("case", list(bad_samples()))
def test_invalid_prompts_name_the_field(case: str) -> None:
    samples, problem = bad_samples()[case]
    with pytest.raises(InvalidInput) as error:
        validate_prompt_audio(samples, 16000, FIELD)
    assert error.value.field == FIELD
    assert problem in str(error.value)


def test_load_prompt_audio_decodes_and_checks() -> None:
    samples, rate = load_prompt_audio(encode(tone(200.0, 1.0, 8000), 8000, "FLAC"), FIELD)
    assert rate == 8000 and samples.shape == (8000,)
    with pytest.raises(InvalidInput, match="silent"):
        load_prompt_audio(encode(np.zeros(8000, np.float32), 8000, "WAV"), FIELD)
    with pytest.raises(InvalidInput, match="at least"):
        load_prompt_audio(encode(tone(200.0, 0.2, 8000), 8000, "WAV"), FIELD)
