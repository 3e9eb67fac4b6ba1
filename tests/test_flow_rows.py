"""The flow estimator's rows solved one by one (models/flow_cache.py `_solve_by_row`), spread over the cores
by `RowWorkers` (pipeline/threads.py).

Each (stream, guidance half) is a pass of its own over just its frames, on a fixed torch thread count, so:
its mel equals the batched solver's within the cache's bound; it is bit for bit the same whether its rows
run one after the other or side by side; `RowWorkers` runs
them on token2wav's share while the LLM is busy and on every core while it is idle, and gives the calling
unit its thread count back.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.flow_cache import FlowCacheSettings, StreamFlowCache, cached_mel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.pipeline.threads import CoreShare, RowWorkers, ThreadPlan, set_torch_threads
from cosyvoice_triton.token2wav.scheduler import ChunkRequest, Token2WavScheduler
from cosyvoice_triton.token2wav.stream import Token2Wav

from test_flow_cache import MEL_ATOL, OFF, WAVE_ATOL, flow_inputs, prompt_slice, speech_tokens, stream_mels

PLAN = ThreadPlan(cores=2, llm=1, token2wav=1)


class Recorded:
    """A map_rows that records which thread ran each row and how many torch threads it had."""

    def __init__(self, workers: RowWorkers):
        self.workers = workers
        self.calls: list[list[tuple[str, int]]] = []

    def __call__(self, fn, rows):
        seen: list[tuple[str, int]] = []

        def wrapped(row):
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            return fn(row)

        out = self.workers.map(wrapped, rows)
        self.calls.append(seen)
        return out


def mixed_batch(flow: FlowModel, golden: dict):
    """Rows with caches of 100 and 50 frames and a final full-attention row (as test_flow_cache)."""
    rows = [(prompt_slice(golden, 0, 20), speech_tokens(100, 5), 78, 53),
            (prompt_slice(golden, 5, 20), speech_tokens(80, 6), 28, 28),
            (prompt_slice(golden, 0, 12), speech_tokens(60, 7), None, None)]
    caches = []
    for prompt, tokens, end, first_chunk in rows:
        cache = StreamFlowCache()
        if end is not None:
            first = flow.conditions(**flow_inputs([prompt], [tokens[:first_chunk]]), streaming=True, finalize=False)
            _, _, (cache,), _ = cached_mel(flow, first, [cache], [10 ** 6], 10 ** 6)
        caches.append(cache)
    streaming = torch.tensor([True, True, False])
    c = flow.conditions(**flow_inputs([r[0] for r in rows], [r[1][:r[2] or len(r[1])] for r in rows]),
                        streaming=streaming, finalize=~streaming)
    return c, caches


def solve(flow: FlowModel, c, caches, map_rows=None):
    mel, starts, kept, _ = cached_mel(flow, c, caches, [300, 300, 300], 10 ** 6, map_rows=map_rows)
    return mel, starts, kept


def test_rows_equal_the_batched_solver(flow: FlowModel, golden: dict) -> None:
    c, caches = mixed_batch(flow, golden)
    want_mel, want_starts, want_kept = solve(flow, c, caches)
    got_mel, got_starts, got_kept = solve(flow, c, caches, RowWorkers(CoreShare(PLAN)).map)
    assert got_starts == want_starts == [100, 50, 0]
    assert got_mel.shape == want_mel.shape
    for b in range(3):  # each row's frames; the batched solver leaves zeros after them too
        assert float((got_mel[b] - want_mel[b]).abs().max()) <= MEL_ATOL, b
    for got, want in zip(got_kept, want_kept):  # the caches grown by the call
        assert got.frames == want.frames
        for got_step, want_step in zip(got.steps, want.steps):
            for g, w in zip(got_step, want_step):  # hidden states of magnitude ~10: float rounding
                assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-4)


def test_a_row_is_the_same_bits_on_one_lane_or_two(flow: FlowModel, golden: dict) -> None:
    c, caches = mixed_batch(flow, golden)
    share = CoreShare(PLAN)
    recorded = Recorded(RowWorkers(share))
    set_torch_threads(2)  # a unit on every core: with the LLM idle, two lanes
    two_lanes, _, kept_two = solve(flow, c, caches, recorded)
    assert all(len({name for name, _ in call}) == 2 for call in recorded.calls)  # two threads ran the rows
    with share.running("llm"):  # the LLM busy beside a unit of one thread: one lane, in the calling thread
        set_torch_threads(1)
        one_lane, _, kept_one = solve(flow, c, caches, recorded)
    assert all(len({name for name, _ in call}) == 1 for call in recorded.calls[-10:])
    assert {threads for call in recorded.calls for _, threads in call} == {1}  # every row on one torch thread
    assert torch.equal(two_lanes, one_lane)
    for a, b in zip(kept_two, kept_one):
        assert all(torch.equal(x, y) for step_a, step_b in zip(a.steps, b.steps) for x, y in zip(step_a, step_b))


def test_row_workers_follow_the_llm_and_give_the_unit_its_threads_back() -> None:
    share = CoreShare(PLAN)
    workers = RowWorkers(share)
    assert workers.threads_per_row == 1 and workers.lanes(unit_threads=1) == 2  # LLM idle: every core
    with share.running("llm"):
        assert workers.lanes(unit_threads=1) == 1  # beside the LLM: the unit's share
        assert workers.lanes(unit_threads=2) == 2  # a unit run alone keeps every core
    set_torch_threads(2)
    assert workers.map(lambda row: row * 10, list(range(5))) == [0, 10, 20, 30, 40]  # in order
    assert workers.map(lambda row: row, []) == []  # a call whose streams have no new frame
    assert torch.get_num_threads() == 2
    big = RowWorkers(CoreShare(ThreadPlan(cores=8, llm=2, token2wav=6)))
    assert big.threads_per_row == 4 and big.lanes(unit_threads=6) == 2


def test_token2wav_and_scheduler_with_rows_equal_the_batched_ones(flow: FlowModel, hift: HiFTGenerator,
                                                                  golden: dict) -> None:
    """A solo stream (Token2Wav: streaming chunks and the final full-attention pass through the rows) and
    two streams batched by the scheduler, against the same stages without rows."""
    map_rows = RowWorkers(CoreShare(PLAN)).map
    prompt, tokens, ends = prompt_slice(golden, 0, 20), speech_tokens(130, 1), [28, 78, 103]
    want = stream_mels(Token2Wav(flow, hift, OFF), prompt, tokens, ends, cache=None)
    got = stream_mels(Token2Wav(flow, hift, map_rows=map_rows), prompt, tokens, ends, StreamFlowCache())
    assert [m.shape for m in got] == [m.shape for m in want]
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= MEL_ATOL

    streams = {"a": (prompt_slice(golden, 0, 20), speech_tokens(90, 2), [28]),
               "b": (prompt_slice(golden, 3, 20), speech_tokens(60, 3), [40])}

    def run(**kwargs) -> dict[str, list[np.ndarray]]:
        scheduler = Token2WavScheduler(flow, hift, clock=lambda: 0.0, **kwargs)
        audio: dict[str, list[np.ndarray]] = {sid: [] for sid in streams}
        for step in range(2):
            batch = [ChunkRequest(sid, tokens[[0, *ends][step]:[*ends, len(tokens)][step]], finalize=step == 1,
                                  prompt=prompt if step == 0 else None, seed=7)
                     for sid, (prompt, tokens, ends) in streams.items()]
            for chunk, samples in zip(batch, scheduler.run(batch)):
                audio[chunk.stream_id].append(samples)
        return audio

    want_audio, got_audio = run(flow_cache=OFF), run(flow_cache=FlowCacheSettings(), map_rows=map_rows)
    for sid in streams:
        assert [a.shape for a in got_audio[sid]] == [a.shape for a in want_audio[sid]]
        assert max(float(np.abs(a - b).max()) for a, b in zip(got_audio[sid], want_audio[sid])) <= WAVE_ATOL
