"""Audio features against reference implementations (where installed), shapes and frame counts."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.config import read_yaml
from cosyvoice_triton.preprocess.features import (MelConfig, kaldi_fbank, kaldi_mel_banks, prompt_mel,
                                                slaney_mel_filterbank, speaker_fbank, whisper_log_mel)


def speechlike(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A harmonic tone with vibrato and a little noise, peak 0.3."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(150.0 * (1 + 0.05 * np.sin(2 * np.pi * 4 * t))) / rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 25) if 150 * k < rate / 2)
    wave = wave * (1.2 + np.sin(2 * np.pi * 2 * t)) + 0.02 * rng.standard_normal(t.size)
    return (0.3 * wave / np.abs(wave).max()).astype(np.float32)


@pytest.mark.parametrize("rate, n_fft, n_mels, fmin, fmax", [
    (24000, 1920, 80, 0.0, 8000.0), (16000, 400, 128, 0.0, 8000.0), (16000, 400, 80, 0.0, 8000.0),
    (22050, 1024, 80, 50.0, 11025.0),
])
def test_slaney_filterbank_matches_librosa(rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> None:
    librosa = pytest.importorskip("librosa")
    reference = librosa.filters.mel(sr=rate, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
    ours = slaney_mel_filterbank(rate, n_fft, n_mels, fmin, fmax).numpy()
    assert ours.shape == (n_mels, n_fft // 2 + 1)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-8)


def test_kaldi_mel_banks_shape() -> None:
    banks = kaldi_mel_banks().numpy()
    assert banks.shape == (80, 257)
    assert np.all(banks[:, -1] == 0) and banks.max() <= 1.0 and np.all(banks.sum(axis=1) > 0)


@pytest.mark.parametrize("seconds", [0.5, 2.37])
def test_kaldi_fbank_matches_kaldi_native_fbank(seconds: float) -> None:
    knf = pytest.importorskip("kaldi_native_fbank")
    wav = speechlike(seconds, 16000)
    options = knf.FbankOptions()
    options.frame_opts.dither = 0.0
    options.frame_opts.snip_edges = True
    options.mel_opts.num_bins = 80
    reference_fbank = knf.OnlineFbank(options)
    reference_fbank.accept_waveform(16000, wav.tolist())
    reference_fbank.input_finished()
    reference = np.stack([reference_fbank.get_frame(i) for i in range(reference_fbank.num_frames_ready)])
    ours = kaldi_fbank(wav).numpy()
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, rtol=0, atol=5e-4)


@pytest.mark.parametrize("n_samples, frames", [(399, 0), (400, 1), (559, 1), (560, 2), (16000, 98)])
def test_kaldi_fbank_frame_count(n_samples: int, frames: int) -> None:
    wav = speechlike(1.0, 16000)[:n_samples]
    assert kaldi_fbank(wav).shape == (frames, 80)


def test_speaker_fbank_is_mean_normalized() -> None:
    wav = speechlike(1.5, 16000)
    fbank = speaker_fbank(wav)
    np.testing.assert_allclose(fbank.mean(dim=0).numpy(), 0.0, atol=1e-4)
    np.testing.assert_allclose((kaldi_fbank(wav) - fbank).std(dim=0).numpy(), 0.0, atol=1e-5)


def reference_stft(wav: np.ndarray, n_fft: int, hop: int, win_length: int | None = None) -> np.ndarray:
    """librosa.stft(center=False) in numpy: a periodic Hann window of win_length centred in n_fft, frames every
    hop samples -> (n_fft // 2 + 1, frames) complex. (librosa's own STFT compiles with numba on first use,
    ~20 s on a fresh virtualenv.)"""
    from scipy.signal import get_window
    win_length = win_length or n_fft
    left = (n_fft - win_length) // 2
    window = np.pad(get_window("hann", win_length), (left, n_fft - win_length - left))  # periodic, as librosa's
    frames = np.lib.stride_tricks.sliding_window_view(wav.astype(np.float64), n_fft)[::hop]  # (frames, n_fft)
    return np.fft.rfft(frames * window, axis=1).T


def reference_whisper_log_mel(wav: np.ndarray, n_mels: int) -> np.ndarray:
    """Whisper's recipe written with numpy's FFT and librosa's filters."""
    import librosa
    spectrum = reference_stft(np.pad(wav, 200, mode="reflect"), n_fft=400, hop=160)  # centred frames
    power = np.abs(spectrum[:, :-1]) ** 2
    mel = librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels) @ power
    log_mel = np.log10(np.maximum(mel, 1e-10))
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


@pytest.mark.parametrize("n_mels", [128, 80])
def test_whisper_log_mel_matches_reference(n_mels: int) -> None:
    pytest.importorskip("librosa")
    wav = speechlike(1.23, 16000)
    ours = whisper_log_mel(wav, n_mels=n_mels).numpy()
    reference = reference_whisper_log_mel(wav, n_mels)
    assert ours.shape == reference.shape == (n_mels, len(wav) // 160)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-4)


def reference_prompt_mel(wav: np.ndarray, config: MelConfig) -> np.ndarray:
    """Matcha-TTS's recipe written with numpy padding and FFT and librosa's filters."""
    import librosa
    pad = (config.n_fft - config.hop_size) // 2
    padded = np.pad(wav, (pad, pad), mode="reflect")
    spectrum = reference_stft(padded, n_fft=config.n_fft, hop=config.hop_size, win_length=config.win_size)
    magnitude = np.sqrt(np.abs(spectrum) ** 2 + 1e-9)
    filters = librosa.filters.mel(sr=config.sampling_rate, n_fft=config.n_fft, n_mels=config.num_mels,
                                  fmin=config.fmin, fmax=config.fmax)
    return np.log(np.maximum(filters @ magnitude, 1e-5)).T


def test_prompt_mel_matches_reference() -> None:
    pytest.importorskip("librosa")
    config = MelConfig()
    wav = speechlike(2.01, 24000)
    ours = prompt_mel(wav, config).numpy()
    reference = reference_prompt_mel(wav, config)
    assert ours.shape == reference.shape == (len(wav) // 480, 80)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-4)


@pytest.mark.parametrize("n_samples", [24000, 24479, 24480, 36000 + 123])
def test_prompt_mel_frame_count(n_samples: int) -> None:
    wav = speechlike(2.0, 24000)[:n_samples]
    assert prompt_mel(wav).shape == (n_samples // 480, 80)
    n_16k = n_samples * 2 // 3
    assert whisper_log_mel(speechlike(2.0, 16000)[:n_16k]).shape[1] == n_16k // 160


def test_mel_config_from_yaml(golden_model_dir: Path) -> None:
    config = MelConfig.from_yaml(read_yaml(golden_model_dir / "cosyvoice2.yaml"))
    assert config == MelConfig(n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920,
                               fmin=0, fmax=8000, center=False)
    assert MelConfig.from_yaml({}) == MelConfig()
    assert MelConfig.from_yaml({"feat_extractor": {"__tag__": "!name:x", "hop_size": 256}}).hop_size == 256


def test_filterbanks_are_cached() -> None:
    args = (24000, 1920, 80, 0.0, 8000.0)
    assert slaney_mel_filterbank(*args) is slaney_mel_filterbank(*args)
    assert kaldi_mel_banks() is kaldi_mel_banks()
