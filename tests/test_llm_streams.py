"""LLMStreamForwarder (the llm model's streaming loop) with a real LLMScheduler and a plain fake sender.

`Gate` holds the scheduler inside its next model call until the test opens it, so the test knows where the
scheduler stands when it cancels or stops; no test depends on timing.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import LLMRequest, SamplingParams
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.llm.scheduler import SchedulerUnavailable, LLMScheduler
from cosyvoice_triton.triton.llm_streams import LLMStreamForwarder
from polling import wait_until

pytestmark = pytest.mark.timeout(120)

MAX_SEQ_LEN = 512


class FakeSender:
    """Records what the forwarder sends; `cancelled` plays a client that went away."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.cancelled = False
        self.checks = 0  # is_cancelled() calls
        self.ended = threading.Event()

    def send_tokens(self, tokens: list[int]) -> None:
        assert tokens and not self.ended.is_set()
        self.events.append(("tokens", list(tokens)))

    def send_final(self) -> None:
        self.events.append(("final", None))
        self.ended.set()

    def send_error(self, error: Exception) -> None:
        self.events.append(("error", error))
        self.ended.set()

    def is_cancelled(self) -> bool:
        self.checks += 1
        return self.cancelled

    @property
    def tokens(self) -> list[int]:
        return [t for kind, value in self.events if kind == "tokens" for t in value]

    @property
    def finals(self) -> list[tuple[str, object]]:
        return [event for event in self.events if event[0] != "tokens"]

    def wait(self) -> None:
        assert self.ended.wait(60), "no final response"


class Gate:
    """Replaces `llm.step_logits`: each model call waits until the gate is open."""

    def __init__(self, llm: SpeechLM) -> None:
        self.inner = llm.step_logits
        self.arrived = threading.Event()
        self.go = threading.Event()
        llm.step_logits = self  # the instance attribute shadows the method

    def __call__(self, *args):
        self.arrived.set()
        self.go.wait()
        return self.inner(*args)


def make_request(llm: SpeechLM, name: str, text_len: int, seed: int = 0) -> LLMRequest:
    rng = torch.Generator().manual_seed(100 + seed)
    text = torch.randint(llm.config.qwen.vocab_size, (text_len,), generator=rng).tolist()
    return LLMRequest(stream_id=name, text_tokens=text, prompt_text_tokens=[], prompt_speech_tokens=[],
                      sampling=SamplingParams(), seed=seed)


@pytest.fixture
def make_forwarder(golden_model_dir: Path):
    """make(max_batch, gated) -> (forwarder, gate or None, ends); every forwarder is stopped afterwards."""
    made: list[tuple[LLMStreamForwarder, Gate | None]] = []

    def make(max_batch: int = 2, gated: bool = False):
        llm = SpeechLM.from_model_dir(golden_model_dir, max_batch=max_batch, max_seq_len=MAX_SEQ_LEN)
        gate = Gate(llm) if gated else None
        ends: list[str] = []
        forwarder = LLMStreamForwarder(LLMScheduler(llm, max_batch=max_batch, max_seq_len=MAX_SEQ_LEN, max_queue=4),
                                       on_end=ends.append, cancel_check_s=0.02)
        forwarder.start()
        made.append((forwarder, gate))
        return forwarder, gate, ends

    yield make
    for forwarder, gate in made:
        if gate is not None:
            gate.go.set()
        forwarder.stop()


def engine_tokens(golden_model_dir: Path, request: LLMRequest) -> list[int]:
    """The same request read straight from an scheduler stream of its own."""
    llm = SpeechLM.from_model_dir(golden_model_dir, max_batch=1, max_seq_len=MAX_SEQ_LEN)
    scheduler = LLMScheduler(llm, max_batch=1, max_seq_len=MAX_SEQ_LEN)
    scheduler.start()
    try:
        return [t for piece in scheduler.submit(request) for t in piece]
    finally:
        scheduler.stop()


def test_tokens_are_forwarded_in_order_then_one_final(make_forwarder, golden_model_dir):
    forwarder, _, ends = make_forwarder()
    requests = [make_request(forwarder.scheduler.llm, f"s{i}", text_len=3 + i, seed=i) for i in range(2)]
    senders = [FakeSender() for _ in requests]
    for request, sender in zip(requests, senders):
        forwarder.open(request, sender)
    for request, sender in zip(requests, senders):
        sender.wait()
        assert sender.tokens == engine_tokens(golden_model_dir, request) and sender.tokens
        assert sender.finals == [("final", None)] and sender.events[-1] == ("final", None)
    wait_until(lambda: len(ends) == 2, 30)
    assert set(ends) <= {"stop_token", "max_len"}
    assert forwarder.open_streams == 0 and forwarder.scheduler.stats.slots_free == 2


def test_cancel_by_request_frees_the_slot_and_sends_one_final(make_forwarder):
    forwarder, gate, ends = make_forwarder(gated=True)
    sender = FakeSender()
    forwarder.open(make_request(forwarder.scheduler.llm, "long", text_len=200), sender)
    assert gate.arrived.wait(30)  # the scheduler is in the stream's prefill
    assert forwarder.cancel("long")
    gate.go.set()
    sender.wait()
    assert sender.finals == [("final", None)] and sender.events[-1] == ("final", None)
    assert len(sender.tokens) < 2 * 200  # ended long before its minimum length
    wait_until(lambda: ends == ["cancelled"], 30)
    assert forwarder.scheduler.stats.slots_free == 2 and forwarder.open_streams == 0
    assert not forwarder.cancel("long")  # gone once ended


def test_client_going_away_while_waiting_for_a_slot(make_forwarder):
    forwarder, gate, ends = make_forwarder(max_batch=1, gated=True)
    holder, waiter = FakeSender(), FakeSender()
    forwarder.open(make_request(forwarder.scheduler.llm, "holder", text_len=3), holder)
    assert gate.arrived.wait(30)  # the holder takes the only slot; the scheduler stands in its prefill
    forwarder.open(make_request(forwarder.scheduler.llm, "waiter", text_len=3, seed=1), waiter)
    waiter.cancelled = True
    wait_until(lambda: waiter.checks >= 2, 30)  # the job has seen the cancel and passed it to the scheduler
    gate.go.set()
    waiter.wait()
    holder.wait()
    assert waiter.events == [("final", None)]  # no token, one final
    assert holder.tokens and holder.finals == [("final", None)]
    wait_until(lambda: len(ends) == 2, 30)
    assert "cancelled" in ends and forwarder.scheduler.stats.slots_free == 1 and forwarder.scheduler.stats.queued == 0


def test_a_stream_id_that_is_streaming_is_refused(make_forwarder):
    forwarder, gate, _ = make_forwarder(gated=True)
    first, second = FakeSender(), FakeSender()
    forwarder.open(make_request(forwarder.scheduler.llm, "same", text_len=3), first)
    with pytest.raises(InvalidInput) as refused:
        forwarder.open(make_request(forwarder.scheduler.llm, "same", text_len=4), second)
    assert refused.value.field == "stream_id"
    assert forwarder.scheduler.stats.queued + forwarder.scheduler.stats.active_streams == 1
    gate.go.set()
    first.wait()
    assert first.finals == [("final", None)] and second.events == []
    again = FakeSender()
    forwarder.open(make_request(forwarder.scheduler.llm, "same", text_len=3), again)  # free once ended
    again.wait()
    assert again.finals == [("final", None)]


def test_stop_ends_every_stream_with_one_final_error(make_forwarder):
    forwarder, gate, ends = make_forwarder(max_batch=1, gated=True)
    senders = [FakeSender(), FakeSender()]
    for i, sender in enumerate(senders):  # one holds the slot (held in its prefill), one waits for it
        forwarder.open(make_request(forwarder.scheduler.llm, f"s{i}", text_len=3, seed=i), sender)
    assert gate.arrived.wait(30)
    stopping = threading.Thread(target=forwarder.stop)
    stopping.start()
    for sender in senders:
        sender.wait()  # the finals go out while the scheduler thread still stands in the gate
    gate.go.set()
    stopping.join(60)
    assert not stopping.is_alive()
    for sender in senders:
        ((kind, error),) = sender.finals
        assert kind == "error" and isinstance(error, SchedulerUnavailable)
        assert sender.events[-1][0] == "error"
    assert ends == ["error", "error"]
    with pytest.raises(SchedulerUnavailable):
        forwarder.open(make_request(forwarder.scheduler.llm, "late", text_len=3), FakeSender())
