"""Chunked HiFT vocoding (VocoderStream) against the official streaming token2wav in the golden set."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.config import read_yaml
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import GeneratorNoise, ZeroNoise
from cosyvoice_triton.runtime.vocoder_stream import VocoderStream, VocoderStreamConfig

WAVE_TOL = 1e-3


@pytest.fixture(scope="module")
def hift(golden_model_dir: Path) -> HiFTGenerator:
    return HiFTGenerator.from_model_dir(golden_model_dir)


@pytest.fixture(scope="module")
def stream_chunks(golden: dict[str, np.ndarray], golden_model_dir: Path) -> list[tuple[torch.Tensor, bool]]:
    """The new mel frames of each chunk of the official streaming run, and whether it is the final one.

    Chunk i keeps the flow mel from 2 * offset_i on. The final call starts where the last streaming
    chunk stopped: its token end minus the pre-lookahead tokens, which produced no frames.
    """
    flow = read_yaml(golden_model_dir / "cosyvoice2.yaml")["flow"]
    ratio, lookahead = flow["token_mel_ratio"], flow["pre_lookahead_len"]
    ends, offsets = golden["flow_stream_chunk_token_ends"], golden["flow_stream_chunk_token_offsets"]
    assert list(offsets[1:]) == [end - lookahead for end in ends[:-1]]  # the schedule the README describes
    mels = [golden[f"flow_mel_stream_chunk{i}"] for i in range(len(ends))] + [golden["flow_mel_nonstream"]]
    offsets = [*offsets, ends[-1] - lookahead]
    return [(torch.from_numpy(mel[:, :, ratio * offset:]), i == len(mels) - 1)
            for i, (mel, offset) in enumerate(zip(mels, offsets))]


def run(stream: VocoderStream, chunks: list[tuple[torch.Tensor, bool]]) -> list[torch.Tensor]:
    return [stream.push(mel, finalize) for mel, finalize in chunks]


def test_streaming_matches_official(hift: HiFTGenerator, stream_chunks, golden: dict[str, np.ndarray]):
    stream = VocoderStream(hift, noise=ZeroNoise())
    outputs = run(stream, stream_chunks)
    assert len(outputs) == len([k for k in golden if k.startswith("e2e_stream_chunk")])
    for i, audio in enumerate(outputs):
        expected = golden[f"e2e_stream_chunk{i}"]
        assert audio.shape == expected.shape, i
        assert np.abs(audio.numpy() - expected).max() < WAVE_TOL, i
    assert stream.closed and stream.cached_mel is None and stream.cached_source is None


def test_non_streaming_matches_official(hift: HiFTGenerator, golden: dict[str, np.ndarray]):
    stream = VocoderStream(hift, noise=ZeroNoise())
    audio = stream.push(torch.from_numpy(golden["flow_mel_nonstream"]), finalize=True)
    assert np.abs(audio.numpy() - golden["e2e_nonstream"]).max() < WAVE_TOL


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
