"""Chunked HiFT vocoding (VocoderStream): configuration, stream isolation, closing."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import GeneratorNoise, ZeroNoise
from cosyvoice_triton.token2wav.vocoder_stream import VocoderStream, VocoderStreamConfig


@pytest.fixture(scope="module")
def hift(golden_model_dir: Path) -> HiFTGenerator:
    return HiFTGenerator.from_model_dir(golden_model_dir)


@pytest.fixture(scope="module")
def stream_chunks(golden: dict[str, np.ndarray]) -> list[tuple[torch.Tensor, bool]]:
    """A real mel cut into three chunks, the last one final. (The official chunking against the
    official audio: test_golden.py.)"""
    chunks = torch.tensor_split(torch.from_numpy(golden["hift_in_mel"]), 3, dim=2)  # (1, 80, T) along time
    return [(mel, i == len(chunks) - 1) for i, mel in enumerate(chunks)]


def run(stream: VocoderStream, chunks: list[tuple[torch.Tensor, bool]]) -> list[torch.Tensor]:
    return [stream.push(mel, finalize) for mel, finalize in chunks]


def test_config_defaults(hift: HiFTGenerator):
    config = VocoderStream(hift, noise=ZeroNoise()).config
    assert config == VocoderStreamConfig()
    assert (config.mel_cache_frames, config.source_cache_samples) == (8, 8 * 480)


def test_interleaved_streams_equal_solo_runs(hift: HiFTGenerator, stream_chunks):
    other_chunks = [(mel.flip(2) * 0.9, finalize) for mel, finalize in stream_chunks]
    solo_a = run(VocoderStream(hift, noise=GeneratorNoise.seeded(7)), stream_chunks)
    solo_b = run(VocoderStream(hift, noise=GeneratorNoise.seeded(8)), other_chunks)

    a, b = VocoderStream(hift, noise=GeneratorNoise.seeded(7)), VocoderStream(hift, noise=GeneratorNoise.seeded(8))
    together_a, together_b = [], []
    for (mel_a, fin_a), (mel_b, fin_b) in zip(stream_chunks, other_chunks):
        together_b.append(b.push(mel_b, fin_b))
        together_a.append(a.push(mel_a, fin_a))
    for x, y in zip(solo_a + solo_b, together_a + together_b):
        assert torch.equal(x, y)


def test_closed_stream_refuses_work(hift: HiFTGenerator, stream_chunks):
    stream = VocoderStream(hift, noise=ZeroNoise())
    stream.push(*stream_chunks[0])
    assert stream.cached_source is not None
    stream.close()
    assert stream.cached_mel is None and stream.cached_source is None and stream.cached_audio is None
    with pytest.raises(RuntimeError):
        stream.push(*stream_chunks[1])
