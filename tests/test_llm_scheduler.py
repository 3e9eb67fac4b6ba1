"""The LLM in-flight batching scheduler against `llm_generate.generate`, the single-stream reference.

The scheduler's pace is set by `StepGate`, which wraps `step_logits`: while it is closed, every model call
waits for the test to release it, so the test knows which rounds have run and reads stats while the
scheduler thread stands still. No test depends on timing.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from cosyvoice_triton.errors import InvalidInput, Unavailable
from cosyvoice_triton.random_folder.write import write_random_model
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.llm.scheduler import (SchedulerUnavailable, LLMScheduler, LLMRequest, LLMStepError,
                                                  LLMStream)
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.llm.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)  # a deadlock fails the test instead of hanging the session

MAX_SEQ_LEN = 512


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", backbone_weights=False)


@pytest.fixture
def llm(model_dir: Path) -> SpeechLM:
    return SpeechLM.from_model_dir(model_dir, max_batch=1, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture
def schedulers() -> list[LLMScheduler]:
    """Engines made by a test; stopped after it whatever happened (a gate left closed is opened first)."""
    made: list[LLMScheduler] = []
    yield made
    for scheduler in made:
        gate = vars(scheduler.llm).get("step_logits")
        if isinstance(gate, StepGate):
            gate.open()
        scheduler.stop()


class StepGate:
    """Replaces `llm.step_logits`: records each call's (B, T) and, while closed, holds each call until
    the test releases it. `fail_when(x)` True makes that call raise."""

    def __init__(self, llm: SpeechLM, fail_when: Callable[[Tensor], bool] = lambda x: False):
        self.inner = llm.step_logits
        self.fail_when = fail_when
        self.calls: list[tuple[int, int]] = []
        self.arrivals: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.permits = threading.Semaphore(0)
        self.opened = threading.Event()
        llm.step_logits = self  # the instance attribute shadows the method

    def __call__(self, x: Tensor, input_pos: Tensor, slots: Tensor, kv_len: int | None = None) -> Tensor:
        shape = (x.shape[0], x.shape[1])
        self.calls.append(shape)
        if not self.opened.is_set():
            self.arrivals.put(shape)
            self.permits.acquire()
        if self.fail_when(x):
            raise RuntimeError("injected fault")
        return self.inner(x, input_pos, slots, kv_len)

    def next_call(self) -> tuple[int, int]:
        """Wait until the scheduler blocks in its next model call; return that call's (B, T)."""
        return self.arrivals.get()

    def release(self) -> None:
        self.permits.release()

    def open(self) -> None:
        """Let every call through, the one waiting now included."""
        self.opened.set()
        self.permits.release()

    def decode_sizes(self) -> list[int]:
        return [batch for batch, length in self.calls if length == 1]


def make_request(llm: SpeechLM, name: str, text_len: int, prompt_text_len: int = 0, prompt_speech_len: int = 0,
                 seed: int = 0, sampling: SamplingParams = SamplingParams()) -> LLMRequest:
    rng = torch.Generator().manual_seed(1000 + seed)
    vocab, speech = llm.config.qwen.vocab_size, llm.config.speech_token_size
    return LLMRequest(stream_id=name,
                      text_tokens=torch.randint(vocab, (text_len,), generator=rng).tolist(),
                      prompt_text_tokens=torch.randint(vocab, (prompt_text_len,), generator=rng).tolist(),
                      prompt_speech_tokens=torch.randint(speech, (prompt_speech_len,), generator=rng).tolist(),
                      sampling=sampling, seed=seed)


def solo(llm: SpeechLM, request: LLMRequest) -> list[int]:
    """The reference: `generate` alone, seeded as the scheduler must seed it."""
    tokens = [torch.tensor([ids], dtype=torch.int64).reshape(1, -1)
              for ids in (request.text_tokens, request.prompt_text_tokens, request.prompt_speech_tokens)]
    return list(generate(llm, *tokens, sampling=request.sampling,
                         generator=torch.Generator().manual_seed(request.seed)))


def solo_reason(llm: SpeechLM, request: LLMRequest, tokens: list[int]) -> str:
    """How `generate` ended: it stops after max_len tokens or before a stop token."""
    return "max_len" if len(tokens) == llm.length_limits(len(request.text_tokens))[1] else "stop_token"


def read_all(stream: LLMStream) -> list[int]:
    return [token for chunk in stream for token in chunk]


def requests_of_all_shapes(llm: SpeechLM) -> list[LLMRequest]:
    """Six requests: zero-shot, cross-lingual (no prompts) and instruct (prompt text only), of varied lengths."""
    return [make_request(llm, "zero-shot-a", 3, 4, 12, seed=1),
            make_request(llm, "cross-lingual", 2, seed=2),
            make_request(llm, "instruct", 4, 6, seed=3, sampling=SamplingParams(top_p=0.9, top_k=10)),
            make_request(llm, "zero-shot-b", 5, 2, 30, seed=4),
            make_request(llm, "short", 1, 1, 3, seed=5),
            make_request(llm, "zero-shot-c", 3, 8, 20, seed=6, sampling=SamplingParams(win_size=5, tau_r=0.3))]


def test_each_request_alone_equals_generate(llm: SpeechLM, schedulers: list[LLMScheduler]) -> None:
    requests = requests_of_all_shapes(llm)
    expected = [solo(llm, request) for request in requests]
    scheduler = LLMScheduler(llm, max_batch=4)
    schedulers.append(scheduler)
    scheduler.start()
    for request, tokens in zip(requests, expected):
        stream = scheduler.submit(request)
        assert read_all(stream) == tokens
        assert stream.get() is None  # the end stays
        assert stream.finished and stream.reason == solo_reason(llm, request, tokens)
    assert scheduler.stats.peak_batch_size == 1
    assert scheduler.stats.tokens_total == sum(map(len, expected))


def test_concurrent_streams_with_cancellation_equal_their_solo_runs(llm: SpeechLM,
                                                                     schedulers: list[LLMScheduler]) -> None:
    requests = requests_of_all_shapes(llm)
    expected = [solo(llm, request) for request in requests]
    scheduler = LLMScheduler(llm, max_batch=4)
    schedulers.append(scheduler)
    gate = StepGate(llm)
    streams = [scheduler.submit(request) for request in requests]  # before start: admission order is fixed
    scheduler.start()
    for _ in range(4):  # round 1: four prefills (B = 1) ...
        assert gate.next_call()[0] == 1
        gate.release()
    assert gate.next_call() == (4, 1)  # ... then one decode step for all four
    stats = scheduler.stats
    assert (stats.active_streams, stats.queued, stats.slots_free) == (4, 2, 0)

    cancelled = streams[1:3]
    for stream in cancelled:
        assert stream.get() == expected[streams.index(stream)][:1]  # the prefill's token
        stream.cancel()
        stream.cancel()  # idempotent
    gate.release()  # the decode step still serves them; the next round retires them and admits two more
    assert gate.next_call()[0] == 1  # prefill of the first waiting request
    stats = scheduler.stats
    assert (stats.active_streams, stats.queued) == (3, 1)  # two slots freed, one already refilled
    for stream in cancelled:
        assert stream.finished and stream.reason == "cancelled"
        assert read_all(stream) == expected[streams.index(stream)][1:2]  # the one decode step's token
    gate.open()

    for index in (0, 3, 4, 5):
        assert read_all(streams[index]) == expected[index], requests[index].stream_id
        assert streams[index].reason == solo_reason(llm, requests[index], expected[index])
    assert max(gate.decode_sizes()) == 4 and scheduler.stats.peak_batch_size == 4
    stats = scheduler.stats
    assert (stats.active_streams, stats.queued, stats.slots_free) == (0, 0, 4)
    assert stats.tokens_total == sum(len(expected[i]) for i in (0, 3, 4, 5)) + 2 * 2


def test_a_request_that_arrives_while_others_decode_joins_the_batch(llm: SpeechLM,
                                                                     schedulers: list[LLMScheduler]) -> None:
    first = make_request(llm, "first", 4, 3, 10, seed=7)
    late = make_request(llm, "late", 2, 5, 6, seed=8)
    expected_first, expected_late = solo(llm, first), solo(llm, late)
    scheduler = LLMScheduler(llm, max_batch=2)
    schedulers.append(scheduler)
    gate = StepGate(llm)
    scheduler.start()
    stream_first = scheduler.submit(first)
    assert gate.next_call()[0] == 1  # prefill
    gate.release()
    assert gate.next_call() == (1, 1)  # decoding alone
    stream_late = scheduler.submit(late)
    with pytest.raises(TimeoutError):
        stream_late.get(timeout=0.01)  # nothing yet: the scheduler is inside the other stream's step
    gate.release()
    assert gate.next_call()[0] == 1  # the late request's prefill, before the next decode step
    gate.release()
    assert gate.next_call() == (2, 1)  # one step for both
    assert scheduler.stats.active_streams == 2 and not stream_first.finished
    gate.open()
    assert read_all(stream_first) == expected_first
    assert read_all(stream_late) == expected_late
    assert scheduler.stats.peak_batch_size == 2


def test_eos_waits_for_min_len_then_stops_the_stream(llm: SpeechLM, schedulers: list[LLMScheduler]) -> None:
    with torch.no_grad():
        llm.llm_decoder.bias[llm.config.eos_token] += 100.0  # EOS wins as soon as it is allowed
    request = make_request(llm, "eos", 3, 2, 5, seed=9)
    expected = solo(llm, request)
    assert len(expected) == llm.length_limits(3)[0]
    scheduler = LLMScheduler(llm, max_batch=2)
    schedulers.append(scheduler)
    scheduler.start()
    stream = scheduler.submit(request)
    assert read_all(stream) == expected
    assert stream.reason == "stop_token"
    assert scheduler.stats.slots_free == 2


def test_a_failing_step_fails_only_its_streams(llm: SpeechLM, schedulers: list[LLMScheduler]) -> None:
    bad = make_request(llm, "bad", 3, 0, 7, seed=10)
    good = make_request(llm, "good", 2, 1, 4, seed=11)
    expected_good = solo(llm, good)
    bad_prefill_len = 2 + len(bad.text_tokens) + len(bad.prompt_speech_tokens)
    scheduler = LLMScheduler(llm, max_batch=2)
    schedulers.append(scheduler)
    StepGate(llm, fail_when=lambda x: x.shape[1] == bad_prefill_len).open()
    streams = [scheduler.submit(bad), scheduler.submit(good)]
    scheduler.start()
    with pytest.raises(LLMStepError, match="prefill failed for request bad"):
        read_all(streams[0])
    assert streams[0].reason == "error"
    assert read_all(streams[1]) == expected_good
    again = scheduler.submit(replace(good, stream_id="again"))  # the scheduler lives on
    assert read_all(again) == expected_good
    assert scheduler.stats.slots_free == 2


def test_stop_fails_live_and_waiting_streams_and_ends_the_thread(llm: SpeechLM,
                                                                  schedulers: list[LLMScheduler]) -> None:
    scheduler = LLMScheduler(llm, max_batch=1)
    schedulers.append(scheduler)
    gate = StepGate(llm)
    live = scheduler.submit(make_request(llm, "live", 3, seed=12))
    waiting = scheduler.submit(make_request(llm, "waiting", 3, seed=13))
    scheduler.start()
    gate.next_call()
    gate.release()
    gate.next_call()  # the scheduler is inside a decode step
    stopper = threading.Thread(target=scheduler.stop, daemon=True)
    stopper.start()
    for stream in (live, waiting):  # stop() fails them at once, without waiting for the step
        with pytest.raises(SchedulerUnavailable, match="stopped"):
            read_all(stream)
        assert stream.reason == "error"
    gate.open()
    stopper.join()  # stop() returns once the scheduler thread has exited
    assert not [t for t in threading.enumerate() if t.name == "llm-scheduler" and t.is_alive()]
    stats = scheduler.stats
    assert (stats.active_streams, stats.queued, stats.slots_free) == (0, 0, 1)
    with pytest.raises(SchedulerUnavailable):
        scheduler.submit(make_request(llm, "late", 3))


def test_a_full_queue_refuses_requests(llm: SpeechLM) -> None:
    scheduler = LLMScheduler(llm, max_batch=1, max_queue=2)
    queued = [scheduler.submit(make_request(llm, f"r{i}", 2, seed=i)) for i in range(2)]
    with pytest.raises(SchedulerUnavailable, match="queue is full") as caught:
        scheduler.submit(make_request(llm, "r2", 2))
    assert isinstance(caught.value, Unavailable)  # what the Triton model maps to UNAVAILABLE
    assert scheduler.stats.queued == 2
    scheduler.stop()  # never started: the queued streams fail all the same
    for stream in queued:
        with pytest.raises(SchedulerUnavailable):
            stream.get()


@pytest.mark.parametrize("changes, field", [  # what only the scheduler knows (stream id, seed, sampling: the parse's)
    ({"text_tokens": []}, "text_tokens"),
    ({"text_tokens": [-1]}, "text_tokens"),
    ({"text_tokens": [1, 2.5]}, "text_tokens"),
    ({"prompt_text_tokens": [10**6]}, "prompt_text_tokens"),
    ({"prompt_speech_tokens": [6561]}, "prompt_speech_tokens"),  # stop tokens are no prompt ids
    ({"prompt_speech_tokens": [0] * MAX_SEQ_LEN}, "text_tokens"),  # does not fit the cache
])
def test_invalid_requests_name_the_field(llm: SpeechLM, changes: dict, field: str) -> None:
    scheduler = LLMScheduler(llm, max_batch=1)
    request = replace(make_request(llm, "ok", 2), **changes)
    with pytest.raises(InvalidInput) as caught:
        scheduler.submit(request)
    assert caught.value.field == field
    assert scheduler.stats.queued == 0
