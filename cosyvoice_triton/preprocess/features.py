"""Audio features of a reference recording, each for one consumer.

- `kaldi_fbank` / `speaker_fbank` (16 kHz): Kaldi-style log mel filterbank, 80 bins, for CAM++.
  25 ms povey-windowed frames every 10 ms (edges snipped), per-frame DC removal, pre-emphasis 0.97,
  512-point power spectrum, Kaldi mel banks from 20 Hz to Nyquist, natural log floored at float32
  epsilon. No dither. The speaker variant subtracts the mean over time.
- `whisper_log_mel` (16 kHz): Whisper's log mel spectrogram for the S3 speech tokenizer: 400-point
  periodic-Hann STFT every 160 samples (centred, reflect padding, last frame dropped), power,
  Slaney mel, log10 floored at 1e-10, clipped to 8 below the maximum, then (x + 4) / 4.
- `prompt_mel` (24 kHz): the flow model's mel (Matcha-TTS `mel_spectrogram`): reflect padding of
  (n_fft - hop) / 2 on both sides, uncentred STFT, magnitude sqrt(power + 1e-9), Slaney mel,
  natural log floored at 1e-5. Parameters come from the yaml `feat_extractor` section.

Windows and filterbanks are built once per parameter set and cached.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

FBANK_RATE = 16000
FBANK_FRAME = 400  # 25 ms
FBANK_SHIFT = 160  # 10 ms
FBANK_FFT = 512  # frame zero-padded to the next power of two
FBANK_BINS = 80
FBANK_LOW_HZ = 20.0
PREEMPHASIS = 0.97
POVEY_POWER = 0.85
FLOAT32_EPS = float(np.finfo(np.float32).eps)

WHISPER_RATE = 16000
WHISPER_FFT = 400
WHISPER_HOP = 160


@dataclass(frozen=True)
class MelConfig:
    """Parameters of the 24 kHz prompt mel (the yaml `feat_extractor` keys)."""

    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = 8000.0  # None: Nyquist
    center: bool = False

    @classmethod
    def from_yaml(cls, config: dict) -> MelConfig:
        """Read `config["feat_extractor"]` where present; defaults for missing keys."""
        section = config.get("feat_extractor") or {}
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in section.items() if key in known})


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (3 per 200 Hz) below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz * 3.0 / 200.0
    log_step = math.log(6.4) / 27.0
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / log_step, linear)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), mel * 200.0 / 3.0)


@cache
def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float,
                          fmax: float) -> torch.Tensor:
    """(n_mels, n_fft // 2 + 1) float32 triangles on the Slaney mel scale, area-normalized."""
    fft_hz = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges_mel = np.linspace(_hz_to_slaney_mel(fmin), _hz_to_slaney_mel(fmax), n_mels + 2)
    edges_hz = _slaney_mel_to_hz(edges_mel)  # (n_mels + 2,): left, centre, right of each triangle
    widths = np.diff(edges_hz)
    rising = (fft_hz[None, :] - edges_hz[:-2, None]) / widths[:-1, None]
    falling = (edges_hz[2:, None] - fft_hz[None, :]) / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


def _kaldi_mel(hz: np.ndarray) -> np.ndarray:
    return 1127.0 * np.log1p(np.asarray(hz, dtype=np.float64) / 700.0)


@cache
def kaldi_mel_banks(n_bins: int = FBANK_BINS, sample_rate: int = FBANK_RATE, n_fft: int = FBANK_FFT,
                    low_hz: float = FBANK_LOW_HZ) -> torch.Tensor:
    """(n_bins, n_fft // 2 + 1) float32 Kaldi mel triangles (unnormalized) up to Nyquist.

    Kaldi spaces the triangles evenly on its mel scale and weighs FFT bins 0 .. n_fft/2 - 1 by
    their mel position; the Nyquist bin gets weight 0.
    """
    low_mel, high_mel = _kaldi_mel(low_hz), _kaldi_mel(sample_rate / 2.0)
    step = (high_mel - low_mel) / (n_bins + 1)
    left = low_mel + step * np.arange(n_bins)[:, None]  # (n_bins, 1)
    centre, right = left + step, left + 2 * step
    bin_mel = _kaldi_mel(np.arange(n_fft // 2) * sample_rate / n_fft)[None, :]  # (1, n_fft/2)
    rising = (bin_mel - left) / (centre - left)
    falling = (right - bin_mel) / (right - centre)
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights = np.pad(weights, ((0, 0), (0, 1)))  # the Nyquist bin
    return torch.from_numpy(weights.astype(np.float32))


@cache
def povey_window(length: int = FBANK_FRAME) -> torch.Tensor:
    """(length,) symmetric Hann window raised to the power 0.85."""
    return torch.hann_window(length, periodic=False, dtype=torch.float64).pow(POVEY_POWER).float()


@cache
def hann_window(length: int) -> torch.Tensor:
    """(length,) periodic Hann window."""
    return torch.hann_window(length, periodic=True)


def _as_samples(wav: np.ndarray | torch.Tensor) -> torch.Tensor:
    samples = torch.as_tensor(wav, dtype=torch.float32)
    assert samples.ndim == 1, f"expected mono samples (N,), got {tuple(samples.shape)}"
    return samples


def kaldi_fbank(wav16k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(N,) samples at 16 kHz → (T, 80) log mel energies, T = 1 + (N - 400) // 160 (0 if N < 400)."""
    samples = _as_samples(wav16k)
    if samples.shape[0] < FBANK_FRAME:
        return torch.zeros(0, FBANK_BINS)
    frames = samples.unfold(0, FBANK_FRAME, FBANK_SHIFT)  # (T, 400)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)  # the first sample is its own predecessor
    frames = (frames - PREEMPHASIS * previous) * povey_window()
    spectrum = torch.fft.rfft(frames, n=FBANK_FFT)  # (T, 257), zero-padded to 512
    power = spectrum.real.square() + spectrum.imag.square()
    energies = power @ kaldi_mel_banks().T  # (T, 80)
    return energies.clamp(min=FLOAT32_EPS).log()


def speaker_fbank(wav16k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(T, 80) `kaldi_fbank` minus its mean over time: the CAM++ input."""
    fbank = kaldi_fbank(wav16k)
    return fbank - fbank.mean(dim=0, keepdim=True)


def whisper_log_mel(wav16k: np.ndarray | torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """(N,) samples at 16 kHz → (n_mels, N // 160) Whisper log mel: the S3 tokenizer input."""
    samples = _as_samples(wav16k)
    spectrum = torch.stft(samples, WHISPER_FFT, WHISPER_HOP, window=hann_window(WHISPER_FFT),
                          center=True, pad_mode="reflect", return_complex=True)  # (201, N // 160 + 1)
    power = spectrum[:, :-1].abs().square()
    mel = slaney_mel_filterbank(WHISPER_RATE, WHISPER_FFT, n_mels, 0.0, WHISPER_RATE / 2.0) @ power
    log_mel = mel.clamp(min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


def prompt_mel(wav24k: np.ndarray | torch.Tensor, config: MelConfig = MelConfig()) -> torch.Tensor:
    """(N,) samples at 24 kHz → (T, num_mels) log mel, T = N // hop for the default parameters."""
    samples = _as_samples(wav24k)
    pad = (config.n_fft - config.hop_size) // 2
    padded = F.pad(samples[None, None], (pad, pad), mode="reflect")[0, 0]
    spectrum = torch.stft(padded, config.n_fft, hop_length=config.hop_size, win_length=config.win_size,
                          window=hann_window(config.win_size), center=config.center, pad_mode="reflect",
                          normalized=False, onesided=True, return_complex=True)  # (n_fft/2 + 1, T)
    magnitude = torch.sqrt(spectrum.real.square() + spectrum.imag.square() + 1e-9)
    fmax = config.sampling_rate / 2.0 if config.fmax is None else float(config.fmax)
    filters = slaney_mel_filterbank(config.sampling_rate, config.n_fft, config.num_mels, float(config.fmin), fmax)
    mel = (filters @ magnitude).clamp(min=1e-5).log()  # (num_mels, T)
    return mel.T  # (T, num_mels)
