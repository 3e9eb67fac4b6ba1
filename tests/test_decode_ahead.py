"""The in-process pipeline overlaps the LLM and token2wav: the LLM decodes ahead in its own thread while a
chunk is turned into audio, and the two share the pipeline's torch threads (pipeline/threads.py).

Real components on the tiny random folder: the LLM, flow and HiFT of `CosyVoice2`; the only stand-in is
a token2wav stage around the real one (inside the core share's unit) that reads the threads each chunk
got and, inside a middle chunk, waits for the LLM to move on (it cannot when the LLM pauses while
token2wav runs).
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.perf.bench_official import make_inputs
from cosyvoice_triton.perf.exact_length import exact_length
from cosyvoice_triton.pipeline.threads import CoreShare, ThreadPlan, thread_plan
from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2
from polling import wait_until

pytestmark = pytest.mark.timeout(900)

N = 100  # speech tokens: a first chunk (25 + alignment + 3 lookahead), a middle one (50), the final one


@pytest.fixture(scope="module")
def pipelines(tiny_model_dir: Path) -> dict[bool, CosyVoice2]:
    """Two pipelines of one folder, 2 torch threads each: with and without decode-ahead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        made = {ahead: CosyVoice2.from_model_dir(tiny_model_dir, decode_ahead=ahead) for ahead in (True, False)}
    finally:
        torch.set_num_threads(threads)
    for tts in made.values():
        exact_length(tts.llm, N)
    return made


def audio(tts: CosyVoice2, request) -> list[np.ndarray]:
    return [chunk for chunk in tts.synthesize(request, stream=True) if chunk.size]


class WatchingToken2Wav:
    """The reference token2wav inside the pipeline's core-sharing stage, watched: it records each chunk's
    kind, its torch threads and the tokens the LLM decoded while it ran; in a middle chunk it waits until
    the LLM has decoded past the tokens it had when the chunk began."""

    def __init__(self, inner, decoded):
        self.inner = inner
        self.decoded = decoded  # () -> tokens the LLM has decoded so far
        self.seen: list[tuple[str, int, int]] = []  # (kind, torch threads, tokens decoded during the chunk)

    def chunk(self, chunk):
        kind = "first" if chunk.prompt is not None else "last" if chunk.finalize else "middle"
        before = self.decoded()
        audio = self.inner.chunk(chunk)
        if kind == "middle":
            wait_until(lambda: self.decoded() > before, timeout_s=60, interval_s=0.01)
        self.seen.append((kind, torch.get_num_threads(), self.decoded() - before))
        return audio

    def cancel(self, stream_id):
        self.inner.cancel(stream_id)


class CountingLLM:
    """The pipeline's LLM stage, counting the tokens its streams have produced (in the decoding thread)."""

    def __init__(self, inner):
        self.inner = inner
        self.decoded = 0

    def stream(self, request):
        counter = self
        inner = self.inner.stream(request)

        class Counted:
            def __iter__(self):
                for tokens in inner:
                    counter.decoded += len(tokens)
                    yield tokens

            def cancel(self):
                inner.cancel()

        return Counted()


def test_decode_ahead_gives_the_same_audio(pipelines) -> None:
    request, _ = make_inputs(pipelines[False], text_tokens=6, prompt_tokens=20)
    plain = audio(pipelines[False], request)
    ahead = audio(pipelines[True], request)
    assert len(plain) >= 2  # the first chunk and the final one
    assert [c.size for c in ahead] == [c.size for c in plain]
    # The same tokens; the flow's sums differ by ~1e-6 on token2wav's share of the threads.
    np.testing.assert_allclose(np.concatenate(ahead), np.concatenate(plain), rtol=0, atol=1e-4)
    # And a seed's audio does not depend on timing: the same, bit for bit, run to run.
    np.testing.assert_array_equal(np.concatenate(audio(pipelines[True], request)), np.concatenate(ahead))


def test_a_first_chunk_runs_alone_on_every_core_and_middle_chunks_beside_the_llm(pipelines) -> None:
    tts = pipelines[True]
    pipeline = tts.pipeline
    llm_stage, token2wav_stage = pipeline.llm, pipeline.token2wav
    counting = CountingLLM(llm_stage.inner)
    watching = WatchingToken2Wav(token2wav_stage.inner, lambda: counting.decoded)
    pipeline.llm = type(llm_stage)(counting, llm_stage.share)
    token2wav_stage.inner = watching
    try:
        request, _ = make_inputs(tts, text_tokens=6, prompt_tokens=20)
        audio(tts, request)
    finally:
        pipeline.llm, token2wav_stage.inner = llm_stage, watching.inner
    assert counting.decoded == N
    kinds = [kind for kind, _, _ in watching.seen]
    assert kinds[0] == "first" and kinds[-1] == "last" and "middle" in kinds
    plan = thread_plan(2)
    for kind, threads, decoded_during in watching.seen:
        if kind == "first":  # every core, the LLM waiting (it had tokens left to decode)
            assert (threads, decoded_during) == (plan.cores, 0) == (2, 0)
        elif kind == "middle":  # token2wav's share of 2 threads (1), the LLM decoding beside it
            assert threads == plan.token2wav == 1 and decoded_during > 0
        else:  # after the LLM's end: every core
            assert threads == 2


def test_a_cancelled_stream_stops_its_decoding_before_the_next_request(pipelines) -> None:
    tts = pipelines[True]
    request, _ = make_inputs(tts, text_tokens=6, prompt_tokens=20)
    chunks = tts.synthesize(request, stream=True)
    next(chunks)
    chunks.close()  # the pipeline cancels the LLM stream: its decoding thread has ended
    assert not [t for t in threading.enumerate() if t.name == "llm-decode-ahead"]
    assert [c.size for c in audio(tts, request)] == [c.size for c in audio(pipelines[False], request)]


def test_core_share_gives_a_module_alone_every_core_and_side_by_side_the_plan() -> None:
    share = CoreShare(ThreadPlan(cores=6, llm=2, token2wav=4))
    seen: dict[str, int] = {}
    with share.running("token2wav") as alone:
        assert alone == 6 and torch.get_num_threads() == 6

        def decode() -> None:
            with share.running("llm") as beside:
                seen["llm"] = beside
                seen["llm_torch"] = torch.get_num_threads()

        thread = threading.Thread(target=decode)
        thread.start()
        thread.join()
    with share.running("llm") as alone_again:
        assert alone_again == 6
    assert seen == {"llm": 2, "llm_torch": 2}
    assert torch.get_num_threads() == 6  # this thread's count, not the other thread's


def test_a_unit_run_alone_waits_for_the_other_modules_unit_and_holds_off_its_next() -> None:
    share = CoreShare(ThreadPlan(cores=6, llm=2, token2wav=4))
    step_running, end_step = threading.Event(), threading.Event()
    events: list[str] = []

    def decode_step() -> None:
        with share.running("llm"):
            events.append("llm step")
            step_running.set()
            end_step.wait(timeout=60)

    def first_chunk() -> None:
        with share.running("token2wav", 6, alone=True) as threads:
            events.append(f"first chunk on {threads}")
            next_step = threading.Thread(target=decode_step)
            next_step.start()
            next_step.join(timeout=0.5)  # it waits for this chunk's end
            events.append("first chunk ends")
        next_step.join(timeout=60)

    step = threading.Thread(target=decode_step)
    step.start()
    step_running.wait(timeout=60)
    chunk = threading.Thread(target=first_chunk)
    chunk.start()
    chunk.join(timeout=0.5)  # it waits for the step in progress
    assert events == ["llm step"]
    end_step.set()
    chunk.join(timeout=60)
    step.join(timeout=60)
    assert events == ["llm step", "first chunk on 6", "first chunk ends", "llm step"]
