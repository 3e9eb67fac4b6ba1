"""The quality judge: how far a speed lever moves what a listener hears, measured without phase.

Every change upstream of the vocoder (a flow precision, a chunk preset, a thread count) is judged against the
reference path on the same inputs by measures that a listener's ear agrees with and a vocoder's phase drift
does not move (docs/benchmarks/quality.md: the reasoning, the references, the calibration):

- `snr_db`: 10 log10 of signal over error energy. Of the flow's output mel (`mel_snr_db`), and sample-wise of
  the waveform (`wave_snr_db`: reported, never a gate; a vocoder turns a tiny f0 change into phase drift);
- `log_mel_distance_db`: RMS over frames and bands of the difference of two log-mel spectrograms, in dB;
- `mcd_db`: mel-cepstral distortion (Kubichek 1993) over c1..c24, frame by frame, averaged. The mel-cepstrum
  is the DCT of the natural-log mel amplitude (`mel_cepstrum`), so a gain change (c0) is not counted, and
  MCD is half the RMS dB difference of the two spectral envelopes smoothed to 24 coefficients;
- `f0_track`: f0 every 10 ms from the waveform (YIN); `compare_f0`: over the frames voiced in both, the
  share more than 20 % apart (`f0_gross_errors`: an octave or a harmonic taken for the fundamental, the
  gross pitch error of pitch-tracking evaluations) and the RMSE of the others (`f0_rmse_hz`, `_cents`);
  and `vuv_agreement`, the share of frames whose voicing decision agrees;
- `token_agreement`: the LLM's tokens, equal up to the first difference and overall.

`judge` scores a test path against the reference on one input, from what the caller has: the flow's output
mels, the vocoder's own f0 tracks (its f0 predictor: the pitch it will render) and the waveforms. The mel
measures (`flow_mel_*`) read what the waveform measures would through a vocoder that renders its mel
faithfully. `failures` checks the scores against `BOUNDS`: the flow's mel and the vocoder's f0 always; the
waveform's measures only with a trained vocoder (`trained_vocoder`), since a random-weight vocoder's output
re-analysed is not its mel (docs/benchmarks/quality.md, "Random weights").

Frames are aligned one to one (the same tokens on both sides: equal lengths), no time warping. Waveforms are
analysed at their own rate with an 80 ms Blackman-Harris window (`fft_size`) every 10 ms, 80 Slaney mel bands
up to Nyquist. Pure numpy and scipy; no model code.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np
from scipy.fft import dct
from scipy.signal import get_window

from cosyvoice_triton.preprocess.features import slaney_mel_filterbank

CEPSTRAL_ORDER = 24  # c1..c24, the usual MCD range
FRAME_S = 0.010  # analysis hop of the waveform measures
MEL_BANDS = 80
FLOOR_DB = -80.0  # spectra are floored this far below their loudest mel bin
F0_MIN_HZ, F0_MAX_HZ = 50.0, 600.0
YIN_THRESHOLD = 0.15  # a frame is periodic when its normalised difference dips below this
SILENCE_DB = -50.0  # frames this far below the loudest frame are unvoiced
GROSS_F0_ERROR = 0.2  # relative f0 difference beyond which a frame is a gross error, not a fine one


@dataclass(frozen=True)
class Bounds:
    """What a default lever must keep against the reference (docs/benchmarks/quality.md: why these)."""

    mel_snr_db: float = 35.0  # at least
    log_mel_distance_db: float = 1.0  # at most
    mcd_db: float = 0.5  # at most
    f0_rmse_hz: float = 2.0  # at most, over frames voiced in both, gross errors apart
    f0_gross_errors: float = 0.01  # at most, share of the frames voiced in both
    vuv_agreement: float = 0.99  # at least


BOUNDS = Bounds()

# Which bound each gated score is held to: the flow's mel and the vocoder's f0 always, the waveform's
# measures with a trained vocoder.
UPSTREAM_GATES = {"mel_snr_db": "mel_snr_db", "flow_mel_distance_db": "log_mel_distance_db",
                  "flow_mel_mcd_db": "mcd_db", "vocoder_f0_rmse_hz": "f0_rmse_hz",
                  "vocoder_f0_gross_errors": "f0_gross_errors", "vocoder_vuv_agreement": "vuv_agreement"}
WAVEFORM_GATES = {name: name for name in ("log_mel_distance_db", "mcd_db", "f0_rmse_hz", "f0_gross_errors",
                                          "vuv_agreement")}
HIGHER_IS_BETTER = {"mel_snr_db", "vuv_agreement", "vocoder_vuv_agreement", "wave_snr_db", "voiced_frames"}


@dataclass(frozen=True)
class Scores:
    """One test path against the reference on one input; None where that pair was not given, f0 measures
    None where no frame is voiced in both."""

    mel_snr_db: float | None = None  # the flow's output mel
    flow_mel_distance_db: float | None = None
    flow_mel_mcd_db: float | None = None
    vocoder_f0_rmse_hz: float | None = None  # the vocoder's f0 predictor on the two mels
    vocoder_f0_gross_errors: float | None = None
    vocoder_vuv_agreement: float | None = None
    log_mel_distance_db: float | None = None  # the waveform
    mcd_db: float | None = None
    f0_rmse_hz: float | None = None
    f0_rmse_cents: float | None = None
    f0_gross_errors: float | None = None
    vuv_agreement: float | None = None
    voiced_frames: int | None = None  # waveform frames voiced in both
    wave_snr_db: float | None = None  # reported only

    def as_dict(self) -> dict:
        return asdict(self)


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """10 log10(sum ref^2 / sum (ref - test)^2); inf for identical arrays."""
    reference = np.asarray(reference, np.float64)
    error = float(np.sum((reference - np.asarray(test, np.float64)) ** 2))
    return math.inf if error == 0 else 10 * math.log10(float(np.sum(reference ** 2)) / error)


def fft_size(sample_rate: int) -> int:
    """The analysis window: the power of two nearest 80 ms (2048 at 24 kHz). Long and Blackman-Harris (sidelobes
    -92 dB) so that neighbouring harmonics of a voice above ~90 Hz do not leak into the bands between them: with
    a short Hann window those bands hold the two harmonics' leakage, which adds up by their relative phase."""
    return 1 << round(math.log2(0.080 * sample_rate))


def log_mel(wave: np.ndarray, sample_rate: int) -> np.ndarray:
    """(N,) samples -> (T, 80) natural log of mel amplitude, T = N // hop + 1 (centred frames), unfloored."""
    hop, size = round(FRAME_S * sample_rate), fft_size(sample_rate)
    frames = _frames(np.asarray(wave, np.float64), size, hop)  # (T, size)
    magnitude = np.abs(np.fft.rfft(frames * get_window("blackmanharris", size), axis=1))  # (T, size / 2 + 1)
    filters = slaney_mel_filterbank(sample_rate, size, MEL_BANDS, 0.0, sample_rate / 2.0).numpy()
    return np.log(np.maximum(magnitude @ filters.T.astype(np.float64), 1e-30))


def _frames(wave: np.ndarray, length: int, hop: int) -> np.ndarray:
    """(N,) -> (N // hop + 1, length): frame t centred on sample t * hop, zeros beyond the ends."""
    padded = np.pad(wave, (length // 2, length // 2))
    return np.lib.stride_tricks.sliding_window_view(padded, length)[::hop][:len(wave) // hop + 1]


def _floored(reference: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both log-mels (natural log amplitude), each floored FLOOR_DB below its own loudest bin: near-silent bins
    count alike on both sides, and a gain change stays a gain change."""
    def floored(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64)
        return np.maximum(x, x.max() + FLOOR_DB / 20 * math.log(10))

    return floored(reference), floored(test)


def log_mel_distance_db(reference: np.ndarray, test: np.ndarray) -> float:
    """RMS dB difference of two (T, bands) natural-log amplitude spectrograms."""
    reference, test = _floored(reference, test)
    return float(20 / math.log(10) * np.sqrt(np.mean((reference - test) ** 2)))


def mel_cepstrum(log_mel_amplitude: np.ndarray, order: int = CEPSTRAL_ORDER) -> np.ndarray:
    """(T, K) natural-log mel amplitude -> (T, order) cepstrum c1..c_order, scaled so that
    log|X(w_k)| = c0 + 2 sum_n c_n cos(n w_k) on the K bands' centres w_k = pi (k + 1/2) / K."""
    K = log_mel_amplitude.shape[1]
    return dct(log_mel_amplitude, type=2, axis=1)[:, 1:order + 1] / (2 * K)  # scipy's DCT-II is 2 sum(...)


def mcd_db(reference: np.ndarray, test: np.ndarray, order: int = CEPSTRAL_ORDER) -> float:
    """Mel-cepstral distortion of two (T, bands) natural-log amplitude mel spectrograms, mean over frames:
    10 / ln 10 * sqrt(2 sum_{n=1..order} (c_n - c'_n)^2)."""
    reference, test = _floored(reference, test)
    delta = mel_cepstrum(reference, order) - mel_cepstrum(test, order)
    return float(np.mean(10 / math.log(10) * np.sqrt(2 * np.sum(delta ** 2, axis=1))))


def f0_track(wave: np.ndarray, sample_rate: int) -> tuple[np.ndarray, np.ndarray]:
    """(f0 in Hz (T,), voiced (T,) bool) every FRAME_S, frames centred as `log_mel`'s; YIN (de Cheveigne and
    Kawahara 2002, steps 1-5: difference function, cumulative mean normalisation, absolute threshold, the local
    minimum after it, parabolic interpolation of the difference function). f0 is 0 where unvoiced."""
    wave = np.asarray(wave, np.float64)
    hop = round(FRAME_S * sample_rate)
    tau_min, tau_max = int(sample_rate / F0_MAX_HZ), int(math.ceil(sample_rate / F0_MIN_HZ))
    window = tau_max  # the integration window: one longest period
    frames = _frames(wave, window + tau_max, hop)  # (T, W + tau_max)
    d = _difference(frames, window, tau_max)  # (T, tau_max + 1)
    cmnd = np.ones_like(d)
    cmnd[:, 1:] = d[:, 1:] * np.arange(1, tau_max + 1) / np.maximum(np.cumsum(d[:, 1:], axis=1), 1e-30)
    energy = np.sum(frames[:, :window] ** 2, axis=1)
    loud = energy > energy.max() * 10 ** (SILENCE_DB / 10)
    f0, voiced = np.zeros(len(frames)), np.zeros(len(frames), bool)
    for t in np.flatnonzero(loud):
        below = np.flatnonzero(cmnd[t, tau_min:tau_max] < YIN_THRESHOLD)
        if below.size == 0:
            continue
        tau = tau_min + below[0]
        while tau + 1 < tau_max and cmnd[t, tau + 1] < cmnd[t, tau]:
            tau += 1
        f0[t], voiced[t] = sample_rate / _parabolic(d[t], tau), True  # d: cmnd's normalisation tilts the dip
    return f0, voiced


def _difference(frames: np.ndarray, window: int, tau_max: int) -> np.ndarray:
    """YIN's d_t(tau) = sum_{j < window} (x_j - x_{j + tau})^2 for tau = 0..tau_max, per frame, via one FFT
    correlation and running energies."""
    n = 1 << (frames.shape[1] + window).bit_length()
    spectrum = np.fft.rfft(frames, n, axis=1) * np.conj(np.fft.rfft(frames[:, :window], n, axis=1))
    correlation = np.fft.irfft(spectrum, n, axis=1)[:, :tau_max + 1]  # r(tau) = sum_j x_j x_{j + tau}
    running = np.concatenate([np.zeros((len(frames), 1)), np.cumsum(frames ** 2, axis=1)], axis=1)
    lagged = running[:, window:window + tau_max + 1] - running[:, :tau_max + 1]  # sum_j x_{j + tau}^2
    return np.maximum(running[:, window:window + 1] + lagged - 2 * correlation, 0.0)


def _parabolic(values: np.ndarray, i: int) -> float:
    """The abscissa of the minimum of the parabola through values[i - 1 .. i + 1]."""
    if i <= 0 or i + 1 >= len(values):
        return float(i)
    left, mid, right = values[i - 1], values[i], values[i + 1]
    curvature = left - 2 * mid + right
    return float(i) if curvature <= 0 else i + 0.5 * (left - right) / curvature


def compare_f0(reference: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]) -> dict:
    """Two (f0 Hz, voiced) tracks of equal length -> vuv_agreement, voiced_frames (voiced in both), and over
    those (None if none) f0_gross_errors, and f0_rmse_hz / f0_rmse_cents of the frames without a gross error."""
    (f0_ref, v_ref), (f0_test, v_test) = reference, test
    both = v_ref & v_test
    scores = {"vuv_agreement": float(np.mean(v_ref == v_test)), "voiced_frames": int(both.sum()),
              "f0_gross_errors": None, "f0_rmse_hz": None, "f0_rmse_cents": None}
    if both.any():
        gross = np.abs(f0_test[both] / f0_ref[both] - 1) > GROSS_F0_ERROR
        scores["f0_gross_errors"] = float(gross.mean())
        ref, test_ = f0_ref[both][~gross], f0_test[both][~gross]
        if ref.size:
            scores["f0_rmse_hz"] = float(np.sqrt(np.mean((ref - test_) ** 2)))
            scores["f0_rmse_cents"] = float(np.sqrt(np.mean((1200 * np.log2(test_ / ref)) ** 2)))
    return scores


def judge(sample_rate: int, reference_wave: np.ndarray | None = None, test_wave: np.ndarray | None = None,
          reference_mel: np.ndarray | None = None, test_mel: np.ndarray | None = None,
          reference_f0: tuple[np.ndarray, np.ndarray] | None = None,
          test_f0: tuple[np.ndarray, np.ndarray] | None = None) -> Scores:
    """Scores of a test path against the reference on the same input, from each pair given: the waveforms
    (N,) at `sample_rate`, the flow's output mels (80, T) in natural-log amplitude, the vocoder's f0 tracks
    (f0 Hz (T,), voiced (T,) bool). Each pair of equal shapes."""
    scores = {}
    if reference_mel is not None:
        assert reference_mel.shape == test_mel.shape, (reference_mel.shape, test_mel.shape)
        ref_frames, test_frames = reference_mel.T, test_mel.T  # (80, T) -> (T, 80): frames first
        scores.update(mel_snr_db=snr_db(reference_mel, test_mel),
                      flow_mel_distance_db=log_mel_distance_db(ref_frames, test_frames),
                      flow_mel_mcd_db=mcd_db(ref_frames, test_frames))
    if reference_f0 is not None:
        f0 = compare_f0(reference_f0, test_f0)
        scores.update(vocoder_f0_rmse_hz=f0["f0_rmse_hz"], vocoder_f0_gross_errors=f0["f0_gross_errors"],
                      vocoder_vuv_agreement=f0["vuv_agreement"])
    if reference_wave is not None:
        assert reference_wave.shape == test_wave.shape, (reference_wave.shape, test_wave.shape)
        ref_mel, test_mel_ = log_mel(reference_wave, sample_rate), log_mel(test_wave, sample_rate)
        scores.update(log_mel_distance_db=log_mel_distance_db(ref_mel, test_mel_), mcd_db=mcd_db(ref_mel, test_mel_),
                      wave_snr_db=snr_db(reference_wave, test_wave),
                      **compare_f0(f0_track(reference_wave, sample_rate), f0_track(test_wave, sample_rate)))
    return Scores(**scores)


def failures(scores: Scores, bounds: Bounds = BOUNDS, trained_vocoder: bool = True) -> list[str]:
    """The gated scores outside their bounds (empty: the path passes); scores not measured are skipped."""
    gates = UPSTREAM_GATES | (WAVEFORM_GATES if trained_vocoder else {})
    out = []
    for name, bound_name in gates.items():
        value, bound = getattr(scores, name), getattr(bounds, bound_name)
        if value is not None and (value < bound if name in HIGHER_IS_BETTER else value > bound):
            out.append(name)
    return out


def worst(many: list[Scores]) -> Scores:
    """Each score's worst value over several inputs (seeds, passes): what the bounds are checked against."""
    merged = {}
    for field in fields(Scores):
        values = [getattr(s, field.name) for s in many if getattr(s, field.name) is not None]
        merged[field.name] = (min(values) if field.name in HIGHER_IS_BETTER else max(values)) if values else None
    return Scores(**merged)


def token_agreement(reference: list[int], test: list[int]) -> tuple[float, float]:
    """(share of the reference's tokens before the first difference, share of positions equal overall, a
    length difference counting as different positions)."""
    common = min(len(reference), len(test))
    equal = np.asarray(reference[:common]) == np.asarray(test[:common])
    prefix = common if equal.all() else int(np.argmin(equal))
    return prefix / max(len(reference), 1), float(equal.sum()) / max(len(reference), len(test), 1)
