"""Per-stream flow caches (models/flow_cache.py): a cached streaming call computes only the frames after the
cached ones, and its mel equals the uncached call's.

On the tiny golden folder: a solo stream of several chunks (Token2Wav), the same streams batched together
through the scheduler, a batch mixing cached rows of different cache lengths with a full-attention final row,
the cached streaming final chunk, and the max_frames bound.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_triton.messages import FlowPrompt
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.flow_cache import FlowCacheSettings, StreamFlowCache, cached_mel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.token2wav.stream import Token2Wav
from cosyvoice_triton.token2wav.scheduler import ChunkRequest, Token2WavScheduler

MEL_ATOL = 1e-5  # cached against uncached; measured up to ~3e-6 on the tiny folder
WAVE_ATOL = 1e-4
OFF = FlowCacheSettings(enabled=False)


def prompt_slice(golden: dict, start: int, stop: int) -> FlowPrompt:
    return FlowPrompt(speech_tokens=torch.from_numpy(golden["in_prompt_speech_token"][:, start:stop]),
                      mel=torch.from_numpy(golden["in_prompt_feat"][:, 2 * start:2 * stop]),
                      embedding=torch.from_numpy(golden["in_embedding"]))


def speech_tokens(n: int, seed: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, 6561, size=n).tolist()


def stream_mels(token2wav: Token2Wav, prompt: FlowPrompt, tokens: list[int], ends: list[int],
                cache: StreamFlowCache | None, lookahead: int = 3) -> list[torch.Tensor]:
    """The mel of each non-final chunk ending at ends[i], then the final chunk (as Token2WavStream calls)."""
    mels, offset = [], 0
    for end in ends + [len(tokens)]:
        finalize = end == len(tokens)
        streaming = not finalize or (cache is not None and token2wav.flow_cache.cached_final)
        ids = torch.tensor([tokens[:end]], dtype=torch.int32)
        mels.append(token2wav.mel(ids, prompt, offset, finalize=finalize, streaming=streaming, cache=cache,
                                  next_offset=end - lookahead))
        offset = end - lookahead
    return mels


def assert_mels_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert [m.shape for m in got] == [m.shape for m in want]
    worst = max(float((a - b).abs().max()) for a, b in zip(got, want))
    assert worst <= MEL_ATOL, worst


def test_cached_stream_equals_uncached_and_caches_only_final_chunks(flow: FlowModel, hift: HiFTGenerator,
                                                                      golden: dict) -> None:
    prompt, tokens = prompt_slice(golden, 0, 20), speech_tokens(150, 1)  # 40 prompt frames
    ends = [28, 78, 103, 128]
    want = stream_mels(Token2Wav(flow, hift, OFF), prompt, tokens, ends, cache=None)
    cached = Token2Wav(flow, hift)
    cache = StreamFlowCache()
    got, frames, offset = [], [], 0
    for end in ends + [len(tokens)]:
        finalize = end == len(tokens)
        ids = torch.tensor([tokens[:end]], dtype=torch.int32)
        got.append(cached.mel(ids, prompt, offset, finalize=finalize, streaming=not finalize, cache=cache,
                              next_offset=end - 3))
        frames.append(cache.frames)
        offset = end - 3
    assert_mels_close(got, want)
    # Whole 50-frame chunks whose tokens (prompt 20 + end - 3 look-ahead) are final, up to the next start.
    assert frames == [50, 150, 200, 250, 250]  # the final full-attention chunk adds nothing
    assert len(cache.steps) == flow.config.n_timesteps and cache.nbytes > 0


def test_batched_streams_equal_uncached(flow: FlowModel, hift: HiFTGenerator, golden: dict) -> None:
    """Streams with different prompts, chunk sizes and cache lengths share flow calls, the last one's final
    full-attention chunk alongside the others' cached chunks."""
    streams = {"a": (prompt_slice(golden, 0, 20), speech_tokens(120, 2), [28, 78]),
               "b": (prompt_slice(golden, 3, 20), speech_tokens(100, 3), [40, 60]),
               "c": (prompt_slice(golden, 10, 20), speech_tokens(53, 4), [30])}

    def run(settings: FlowCacheSettings) -> tuple[dict[str, list[np.ndarray]], list[int]]:
        scheduler = Token2WavScheduler(flow, hift, flow_cache=settings, clock=lambda: 0.0)  # no idle frees
        audio: dict[str, list[np.ndarray]] = {sid: [] for sid in streams}
        cached_bytes = []
        for step in range(3):
            batch = []
            for sid, (prompt, tokens, ends) in streams.items():
                bounds = [0] + ends + [len(tokens)]
                if step < len(bounds) - 1:
                    batch.append(ChunkRequest(sid, tokens[bounds[step]:bounds[step + 1]],
                                              finalize=step == len(bounds) - 2,
                                              prompt=prompt if step == 0 else None, seed=7))
            for chunk, samples in zip(batch, scheduler.run(batch)):
                assert isinstance(samples, np.ndarray), samples
                audio[chunk.stream_id].append(samples)
            cached_bytes.append(scheduler.stats.flow_cache_bytes)
        assert scheduler.stats.max_flow_batch == 3
        return audio, cached_bytes

    want, no_bytes = run(OFF)
    got, cached_bytes = run(FlowCacheSettings())
    assert no_bytes == [0, 0, 0] and cached_bytes[0] > 0 and cached_bytes[-1] == 0  # freed on the final chunks
    for sid in streams:
        assert [a.shape for a in got[sid]] == [a.shape for a in want[sid]]
        assert max(float(np.abs(a - b).max()) for a, b in zip(got[sid], want[sid])) <= WAVE_ATOL, sid


def test_batch_of_different_cache_lengths(flow: FlowModel, golden: dict) -> None:
    """cached_mel itself: rows with caches of 100 and 50 frames and a non-streaming row without one."""
    rows = [(prompt_slice(golden, 0, 20), speech_tokens(100, 5), 78),
            (prompt_slice(golden, 5, 20), speech_tokens(80, 6), 28),
            (prompt_slice(golden, 0, 12), speech_tokens(60, 7), None)]  # None: final, full attention
    first_chunks = [53, 28, None]
    caches, solo = [], []
    for (prompt, tokens, end), first_chunk in zip(rows, first_chunks):
        inputs = flow_inputs([prompt], [tokens[:end or len(tokens)]])
        streaming = end is not None
        solo.append(flow.inference(**inputs, streaming=streaming, finalize=not streaming))
        cache = StreamFlowCache()
        if streaming:  # a first chunk fills the cache
            first = flow.conditions(**flow_inputs([prompt], [tokens[:first_chunk]]), streaming=True, finalize=False)
            _, _, (cache,), _ = cached_mel(flow, first, [cache], [10 ** 6], 10 ** 6)
        caches.append(cache)
    assert [c.frames for c in caches] == [100, 50, 0]
    prompts, tokens = [r[0] for r in rows], [r[1][:r[2] or len(r[1])] for r in rows]
    streaming = torch.tensor([True, True, False])
    c = flow.conditions(**flow_inputs(prompts, tokens), streaming=streaming, finalize=~streaming)
    mel, starts, _, _ = cached_mel(flow, c, caches, [10 ** 6] * 3, 10 ** 6)
    assert starts == [100, 50, 0]
    for b, (prompt, _, _) in enumerate(rows):
        P = prompt.mel.shape[1]
        n = int(c.mel_len[b]) - starts[b]
        got = mel[b, :, max(P - starts[b], 0):n]
        want = solo[b][0, :, max(starts[b] - P, 0):int(c.out_len[b])]
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= MEL_ATOL, b


def flow_inputs(prompts: list[FlowPrompt], tokens: list[list[int]]) -> dict:
    pad = torch.nn.utils.rnn.pad_sequence
    lengths = lambda ts: torch.tensor([t.shape[0] for t in ts])  # noqa: E731
    token = [torch.tensor(t, dtype=torch.int32) for t in tokens]
    prompt_token = [p.speech_tokens[0] for p in prompts]
    prompt_feat = [p.mel[0] for p in prompts]
    return dict(token=pad(token, batch_first=True), token_len=lengths(token),
                prompt_token=pad(prompt_token, batch_first=True), prompt_token_len=lengths(prompt_token),
                prompt_feat=pad(prompt_feat, batch_first=True), prompt_feat_len=lengths(prompt_feat),
                embedding=torch.cat([p.embedding for p in prompts]))


def test_cached_final_chunk_equals_uncached_streaming_final(flow: FlowModel, hift: HiFTGenerator,
                                                            golden: dict) -> None:
    prompt, tokens = prompt_slice(golden, 0, 20), speech_tokens(90, 8)
    settings = FlowCacheSettings(cached_final=True)
    got = stream_mels(Token2Wav(flow, hift, settings), prompt, tokens, [28, 78], StreamFlowCache())
    ids = torch.tensor([tokens], dtype=torch.int32)
    full = Token2Wav(flow, hift, OFF).mel(ids, prompt, 75, finalize=True, streaming=True)
    assert_mels_close(got[-1:], [full])


def test_max_frames_bounds_the_cache(flow: FlowModel, hift: HiFTGenerator, golden: dict) -> None:
    prompt, tokens = prompt_slice(golden, 0, 20), speech_tokens(130, 9)
    ends = [28, 78, 103]
    want = stream_mels(Token2Wav(flow, hift, OFF), prompt, tokens, ends, cache=None)
    bounded = Token2Wav(flow, hift, FlowCacheSettings(max_frames=120))
    cache = StreamFlowCache()
    got = stream_mels(bounded, prompt, tokens, ends, cache)
    assert_mels_close(got, want)
    assert cache.frames == 100  # whole chunks under the bound
