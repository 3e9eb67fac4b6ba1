"""CosyVoice3's vocoder stream on a bounded window (token2wav/causal_vocoder_stream.py) against the official
way, the vocoder re-run on all the mel so far at every chunk and the samples after those already sent.

On the tiny CosyVoice3 golden folder, with a random mel of several seconds: the fixed noise and no noise,
chunks on the official schedule and uneven ones smaller than the window's context; in float64, where only
a too-short context, a lost phase or noise read at the wrong samples could move the audio, each of which
the test shows it would catch; two streams interleaved. The golden chunks themselves are checked in
test_golden_cv3.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.models import causal_hift
from cosyvoice_triton.models.causal_hift import CausalHiFTGenerator
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.token2wav.causal_vocoder_stream import CausalVocoderStream

MODEL = Path(__file__).resolve().parent / "golden" / "cv3" / "tiny" / "model"
WAVE_ATOL = 1e-5  # float32 window against the whole-mel re-run (measured ~1e-7)
EXACT_ATOL = 1e-12  # the same in float64: only a real difference shows (measured ~1e-14)
OFFICIAL_ENDS = [60, 160, 360, 430]  # mel frames so far at each call, as the official schedule's chunks
UNEVEN_ENDS = [13, 30, 41, 90, 95, 200, 207, 430]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hift() -> CausalHiFTGenerator:
    return family_models(MODEL).load_vocoder(MODEL)


@pytest.fixture(scope="module")
def hift64() -> CausalHiFTGenerator:
    return family_models(MODEL).load_vocoder(MODEL).double()


def random_mel(frames: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The golden set's calibration distribution: F0 about 60 +- 60 Hz, voiced and unvoiced frames."""
    return torch.from_numpy(np.random.RandomState(seed).randn(1, 80, frames) * 1.25).to(dtype)


def official(hift: CausalHiFTGenerator, mel: torch.Tensor, ends: list[int], noise=None) -> list[torch.Tensor]:
    """The official token2wav's vocoding: each call on all the mel so far, the samples after those sent."""
    chunks, sent = [], 0
    for i, end in enumerate(ends):
        speech, _ = hift.inference(mel[:, :, :end], finalize=i == len(ends) - 1, noise=noise)
        chunks.append(speech[:, sent:])
        sent += chunks[-1].shape[1]
    return chunks


def streamed(stream: CausalVocoderStream, mel: torch.Tensor, ends: list[int]) -> list[torch.Tensor]:
    chunks, start = [], 0
    for i, end in enumerate(ends):
        chunks.append(stream.push(mel[:, :, start:end], finalize=i == len(ends) - 1))
        start = end
    return chunks


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert [a.shape for a in got] == [b.shape for b in want]
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


@pytest.mark.parametrize("ends", [OFFICIAL_ENDS, UNEVEN_ENDS], ids=["official", "uneven"])
@pytest.mark.parametrize("noise", [None, ZeroNoise()], ids=["fixed-noise", "zero-noise"])
def test_window_equals_the_official_rerun(hift: CausalHiFTGenerator, ends: list[int], noise) -> None:
    mel = random_mel(ends[-1], 11)
    stream, kept, start, got = CausalVocoderStream(hift, noise), [], 0, []
    for i, end in enumerate(ends):
        got.append(stream.push(mel[:, :, start:end], finalize=i == len(ends) - 1))
        kept.append(None if stream.mel is None else stream.mel.shape[2])
        start = end
    assert max_error(got, official(hift, mel, ends, noise)) <= WAVE_ATOL
    # Bounded: the window keeps the context before the next sample to emit and the frames held back.
    window = hift.context_frames + hift.config.held_back_frames
    assert kept == [min(end, window) for end in ends[:-1]] + [None]
    assert stream.closed and stream.mel is None and stream.cycles is None


def test_window_is_exact_in_float64(hift64: CausalHiFTGenerator) -> None:
    mel = random_mel(UNEVEN_ENDS[-1], 12, torch.float64)
    want = official(hift64, mel, UNEVEN_ENDS)
    assert max_error(streamed(CausalVocoderStream(hift64), mel, UNEVEN_ENDS), want) <= EXACT_ATOL


def test_the_float64_check_catches_each_carried_part(hift64: CausalHiFTGenerator, monkeypatch) -> None:
    """A window 6 frames short of the layers' reach, the phase not carried, or the noise read from sample 0
    again: each moves the audio far beyond the float64 tolerance."""
    mel = random_mel(OFFICIAL_ENDS[-1], 13, torch.float64)
    want = official(hift64, mel, OFFICIAL_ENDS)

    class NoPhase(CausalVocoderStream):
        def _keep(self, mel, cycles, source_start):
            super()._keep(mel, cycles, source_start)
            self.cycles = torch.zeros_like(self.cycles)

    assert max_error(streamed(NoPhase(hift64), mel, OFFICIAL_ENDS), want) > 1e-3
    with monkeypatch.context() as patch:
        patch.setattr(causal_hift, "ShiftedNoise", lambda noise, offset: noise)
        assert max_error(streamed(CausalVocoderStream(hift64), mel, OFFICIAL_ENDS), want) > 1e-4
    context = hift64.context_frames
    monkeypatch.setattr(CausalHiFTGenerator, "context_frames", property(lambda self: context - 6))
    assert max_error(streamed(CausalVocoderStream(hift64), mel, OFFICIAL_ENDS), want) > 1e-9


def test_two_streams_interleaved_equal_each_alone(hift: CausalHiFTGenerator) -> None:
    mels, ends = [random_mel(430, 21), random_mel(207, 22)], [OFFICIAL_ENDS, UNEVEN_ENDS[:7]]
    alone = [streamed(CausalVocoderStream(hift), mel, e) for mel, e in zip(mels, ends)]
    streams, starts, got = [CausalVocoderStream(hift), CausalVocoderStream(hift)], [0, 0], [[], []]
    for step in range(max(len(e) for e in ends)):
        for i, (stream, mel, e) in enumerate(zip(streams, mels, ends)):
            if step < len(e):
                got[i].append(stream.push(mel[:, :, starts[i]:e[step]], finalize=step == len(e) - 1))
                starts[i] = e[step]
    for g, a in zip(got, alone):
        assert all(torch.equal(x, y) for x, y in zip(g, a))
