"""End to end against the official `CosyVoice2Model.tts` (voice-conversion entry: fixed tokens, no LLM).

The chunk schedule, the flow's streaming calls and the vocoder caches must together reproduce the
official streaming chunks, and the offline path the official offline audio (HiFT noise zeroed, as the
golden set was made). Tolerance 1e-3: our flow is within 1e-5 of the golden mel (README, "End to end").
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.runtime.chunk_policy import ChunkPolicy
from cosyvoice_triton.runtime.token2wav import FlowPrompt, Token2Wav

E2E_ATOL = 1e-3


@pytest.fixture(scope="module")
def token2wav(golden_model_dir) -> Token2Wav:
    return Token2Wav(FlowModel.from_model_dir(golden_model_dir), HiFTGenerator.from_model_dir(golden_model_dir))


@pytest.fixture(scope="module")
def prompt(golden) -> FlowPrompt:
    return FlowPrompt(speech_tokens=torch.from_numpy(golden["in_prompt_speech_token"]),
                      mel=torch.from_numpy(golden["in_prompt_feat"]),
                      embedding=torch.from_numpy(golden["in_embedding"]))


def stream_chunks(token2wav: Token2Wav, prompt: FlowPrompt, tokens: list[int], policy: ChunkPolicy) -> list[np.ndarray]:
    """Feed tokens one by one, as an LLM would, and cut chunks by the schedule."""
    schedule = policy.schedule(prompt.speech_tokens.shape[1])
    stream = token2wav.stream(prompt, ZeroNoise(), lookahead=policy.lookahead)
    chunks, sent = [], 0
    for count in range(1, len(tokens) + 1):
        if count >= schedule.needed:
            _, end = schedule.advance()
            chunks.append(stream.chunk(tokens[sent:end], finalize=False))
            sent = end
    chunks.append(stream.chunk(tokens[sent:], finalize=True))
    return chunks


def test_streaming_matches_official_chunks(token2wav, prompt, golden):
    tokens = golden["flow_token"][0].tolist()
    chunks = stream_chunks(token2wav, prompt, tokens, ChunkPolicy())
    expected = [golden[k][0] for k in sorted(k for k in golden if k.startswith("e2e_stream_chunk"))]
    assert [c.shape for c in chunks] == [e.shape for e in expected]
    for got, want in zip(chunks, expected):
        assert np.abs(got - want).max() < E2E_ATOL


def test_schedule_matches_official_token_ends(prompt, golden):
    schedule = ChunkPolicy().schedule(prompt.speech_tokens.shape[1])
    ends = [schedule.advance()[1] for _ in golden["flow_stream_chunk_token_ends"]]
    assert ends == golden["flow_stream_chunk_token_ends"].tolist()


def test_offline_matches_official(token2wav, prompt, golden):
    audio = token2wav.stream(prompt, ZeroNoise()).chunk(golden["flow_token"][0].tolist(), finalize=True)
    assert audio.shape == golden["e2e_nonstream"][0].shape
    assert np.abs(audio - golden["e2e_nonstream"][0]).max() < E2E_ATOL


def test_streaming_concatenation_is_close_to_offline_length(token2wav, prompt, golden):
    tokens = golden["flow_token"][0].tolist()
    chunks = stream_chunks(token2wav, prompt, tokens, ChunkPolicy())
    assert sum(c.size for c in chunks) == golden["e2e_nonstream"].shape[1]
