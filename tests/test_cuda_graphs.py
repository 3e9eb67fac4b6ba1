"""CUDA graphs of the served hot loops (engines/cuda_graphs.py, llm/decode_graphs.py), on the CPU.

No GPU here, so the capture is replaced by `EagerReplay`, which keeps CudaGraphCall's contract (inputs copied
into the buffers of the capture's shapes, a fixed output overwritten by each call) but runs the function
eagerly. What is tested is everything around the capture: the buckets, the padding (LLM rows on the scratch
slot, estimator rows and frames masked), that the served classes (`LLMScheduler`, `Token2WavScheduler`) give
the same tokens and audio as without graphs, and the fallbacks: a failed capture (the real CudaGraphCall on
the CPU fails) turns the table eager with one log line, a call past the largest bucket runs eager.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.engines.cuda_graphs import (EstimatorGraphs, bucket_for, capture_estimator_steps,
                                                  power_buckets, step_buckets, use_cuda_graphs)
from cosyvoice_triton.llm.decode_graphs import DecodeGraphs
from cosyvoice_triton.llm.scheduler import LLMScheduler
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.token2wav.scheduler import ChunkRequest, Token2WavScheduler

from test_flow_cache import OFF, WAVE_ATOL, prompt_slice, speech_tokens
from test_llm_scheduler import MAX_SEQ_LEN, make_request, read_all, solo

pytestmark = pytest.mark.timeout(300)


class EagerReplay:
    """CudaGraphCall's contract, run eagerly: fixed input buffers of the capture's shapes, one output buffer."""

    def __init__(self, fn, example_inputs):
        self.fn = fn
        self.inputs = tuple(x.clone() for x in example_inputs)
        self.output = fn(*self.inputs).clone()
        self.calls = 0

    def __call__(self, *inputs):
        for buffer, x in zip(self.inputs, inputs):
            if x.shape != buffer.shape:
                raise ValueError(f"captured for {tuple(buffer.shape)}, got {tuple(x.shape)}")
            buffer.copy_(x)
        self.output.copy_(self.fn(*self.inputs))
        self.calls += 1
        return self.output


class Captures:
    """A capture function that records each capture (and can be made to fail)."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.made: list[EagerReplay] = []

    def __call__(self, fn, example_inputs):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.made.append(EagerReplay(fn, example_inputs))
        return self.made[-1]


def test_buckets() -> None:
    assert power_buckets(1) == (1,)
    assert power_buckets(8) == (1, 2, 4, 8)
    assert power_buckets(6) == (1, 2, 4, 6)
    assert step_buckets(250, 100) == (100, 200, 300)
    assert bucket_for(3, (1, 2, 4, 8)) == 4 and bucket_for(4, (1, 2, 4, 8)) == 4
    assert bucket_for(9, (1, 2, 4, 8)) is None


def test_the_setting(caplog: pytest.LogCaptureFixture) -> None:
    assert use_cuda_graphs("auto", "cuda:0") and use_cuda_graphs("on", "cuda")
    assert not use_cuda_graphs("off", "cuda") and not use_cuda_graphs("auto", "cpu")
    with caplog.at_level(logging.WARNING):
        assert not use_cuda_graphs("on", "cpu")
    assert "need a CUDA device" in caplog.text
    with pytest.raises(ValueError, match="cuda_graphs"):
        use_cuda_graphs("yes", "cuda")


# ---- the LLM's decode step ---------------------------------------------------------------------------

@pytest.fixture
def llm(tiny_model_dir: Path) -> SpeechLM:
    return SpeechLM.from_model_dir(tiny_model_dir, max_batch=1, max_seq_len=MAX_SEQ_LEN)


def run_streams(scheduler: LLMScheduler, requests) -> list[list[int]]:
    scheduler.start()
    try:
        streams = [scheduler.submit(request) for request in requests]
        return [read_all(stream) for stream in streams]
    finally:
        scheduler.stop()


def three_requests(llm: SpeechLM):
    return [make_request(llm, "a", 6, prompt_text_len=3, prompt_speech_len=5, seed=1),
            make_request(llm, "b", 4, seed=2), make_request(llm, "c", 9, prompt_speech_len=12, seed=3)]


def test_decode_graphs_pad_to_a_bucket_and_give_the_solo_tokens(llm: SpeechLM) -> None:
    """Three streams decode in the 4-row bucket (one padded row on the scratch slot) and two, then one, as
    streams end; each stream's tokens equal its solo `generate`."""
    requests = three_requests(llm)
    alone = [solo(llm, request) for request in requests]
    captures = Captures()
    scheduler = LLMScheduler(llm, max_batch=4, max_seq_len=MAX_SEQ_LEN, cuda_graphs=True, graph_capture=captures)
    assert llm.backbone.max_batch == 5 and scheduler.decode_graphs.scratch_slot == 4
    assert scheduler.decode_graphs.row_buckets == (1, 2, 4)
    assert run_streams(scheduler, requests) == alone
    keys = set(scheduler.decode_graphs.table.graphs)
    assert (4, 128) in keys and {rows for rows, _ in keys} == {1, 2, 4}
    assert all(kv_len % 128 == 0 for _, kv_len in keys)  # the scheduler's kv buckets
    assert sum(c.calls for c in captures.made) > 0
    # A padded row writes into the scratch slot only: every padded row of a replay points there.
    four = scheduler.decode_graphs.table.graphs[(4, 128)]
    assert four.inputs[2].tolist()[3] == 4


def test_warm_up_captures_each_rows_bucket_per_cache_length(llm: SpeechLM) -> None:
    scheduler = LLMScheduler(llm, max_batch=3, max_seq_len=MAX_SEQ_LEN, cuda_graphs=True, graph_capture=Captures())
    assert scheduler.decode_graphs.warm_up() == 3 * 4  # rows 1, 2, 3 x kv_len 128 .. 512
    assert scheduler.decode_graphs.warm_up_report().startswith("12 decode-step buckets captured in ")
    failing = LLMScheduler(llm, max_batch=3, max_seq_len=MAX_SEQ_LEN, cuda_graphs=True,
                           graph_capture=Captures(fail=True))
    assert failing.decode_graphs.warm_up_report().startswith("eager after a failed capture (RuntimeError: ")
    with pytest.raises(ValueError, match="scratch slot"):
        DecodeGraphs(llm, max_batch=8)


def test_a_failed_capture_runs_eager_with_one_log_line(llm: SpeechLM, caplog: pytest.LogCaptureFixture) -> None:
    """The real CudaGraphCall refuses CPU tensors: the first capture fails, the table turns eager for good,
    and the tokens are the eager scheduler's."""
    requests = three_requests(llm)
    eager = run_streams(LLMScheduler(llm, max_batch=4, max_seq_len=MAX_SEQ_LEN), requests)
    with caplog.at_level(logging.WARNING):
        scheduler = LLMScheduler(llm, max_batch=4, max_seq_len=MAX_SEQ_LEN, cuda_graphs=True)
        assert run_streams(scheduler, requests) == eager
    assert scheduler.decode_graphs.table.failure.startswith("ValueError")
    assert scheduler.decode_graphs.table.graphs == {}
    assert caplog.text.count("CUDA graph capture failed") == 1


# ---- the flow estimator's step -----------------------------------------------------------------------

@pytest.fixture
def own_flow(golden_model_dir: Path) -> FlowModel:
    """A flow of its own: the graphs take the place of its estimator."""
    return FlowModel.from_model_dir(golden_model_dir)


def estimator_inputs(flow: FlowModel, rows: int, frames: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([frames - 7 * b for b in range(rows)])
    mask = (torch.arange(frames)[None] < lengths[:, None]).float()[:, None]  # (B, 1, T)
    x, mu, cond = (torch.randn(rows, 80, frames, generator=g) * mask for _ in range(3))
    t, spks = torch.rand(rows, generator=g), torch.randn(rows, 80, generator=g)
    streaming = torch.tensor([b % 2 == 0 for b in range(rows)])
    return x, mask, mu, t, spks, cond, streaming


def test_estimator_graphs_pad_rows_and_frames_and_equal_the_estimator(own_flow: FlowModel) -> None:
    estimator = own_flow.decoder.estimator
    captures = Captures()
    graphs = EstimatorGraphs(estimator, max_rows=8, capture=captures, max_frames=300)
    inputs = estimator_inputs(own_flow, rows=3, frames=137, seed=0)  # -> the (4 rows, 200 frames) bucket
    with torch.inference_mode():
        want = estimator(*inputs)
        got = graphs(*inputs)
        assert list(graphs.table.graphs) == [(4, 200, False)]
        assert float((got - want).abs().max()) <= 1e-5
        again = graphs(*estimator_inputs(own_flow, rows=3, frames=120, seed=1))  # the same bucket, replayed
        assert len(captures.made) == 1 and captures.made[0].calls == 2
        assert float((got - want).abs().max()) <= 1e-5  # a copy: the replay did not overwrite it
        assert again.shape == (3, 80, 120)
        longer = estimator_inputs(own_flow, rows=2, frames=310, seed=2)  # past the largest bucket: eager
        assert torch.equal(graphs(*longer), estimator(*longer))
        assert len(graphs.table.graphs) == 1


def test_token2wav_with_estimator_graphs_equals_the_uncached_scheduler(own_flow: FlowModel, hift: HiFTGenerator,
                                                                        golden: dict) -> None:
    """Two streams through the served Token2WavScheduler, chunk by chunk, with the estimator's graphs (which
    turn the flow cache off, as graph engines do) against the scheduler without cache."""
    streams = {"a": (prompt_slice(golden, 0, 20), speech_tokens(90, 2), 28),
               "b": (prompt_slice(golden, 3, 20), speech_tokens(60, 3), 40)}

    def run(flow: FlowModel, **kwargs) -> tuple[Token2WavScheduler, dict[str, list[np.ndarray]]]:
        scheduler = Token2WavScheduler(flow, hift, clock=lambda: 0.0, **kwargs)
        audio: dict[str, list[np.ndarray]] = {sid: [] for sid in streams}
        for step in range(2):
            batch = [ChunkRequest(sid, tokens[:end] if step == 0 else tokens[end:], finalize=step == 1,
                                  prompt=prompt if step == 0 else None, seed=7)
                     for sid, (prompt, tokens, end) in streams.items()]
            for chunk, samples in zip(batch, scheduler.run(batch)):
                audio[chunk.stream_id].append(samples)
        return scheduler, audio

    _, want = run(own_flow, flow_cache=OFF)
    captures = Captures()
    assert capture_estimator_steps(own_flow, max_batch=4, capture=captures)
    assert not capture_estimator_steps(own_flow, max_batch=4)  # already replaced: left as it is
    scheduler, got = run(own_flow)  # the default settings: flow cache on
    assert scheduler.flow_cache is None  # graphs recompute every frame, as graph engines
    assert {key[0] for key in own_flow.decoder.estimator.table.graphs} == {4}  # 2 streams x 2 guidance halves
    assert sum(c.calls for c in captures.made) == 2 * own_flow.config.n_timesteps  # 2 calls of 10 steps
    for sid in streams:
        assert [a.shape for a in got[sid]] == [a.shape for a in want[sid]]
        assert max(float(np.abs(a - b).max()) for a, b in zip(got[sid], want[sid])) <= WAVE_ATOL
