"""Admission control (cosyvoice_triton/admission.py): the policy, the cosyvoice2 models' request pool, and
the gateway under overload on a real tritonserver (refused at once with 503 + Retry-After, never left to
time out), plus streams that fail after their first byte (seen as failures by HTTP, WebSocket and SDK)."""
from __future__ import annotations

import threading

import pytest

from cosyvoice_triton.admission import (
    AdmissionPolicy,
    Load,
    SpeedMeter,
    estimate_wait,
    refusal,
)
from cosyvoice_triton.errors import Unavailable
from cosyvoice_triton.triton.decoupled import RequestPool


# ---- the policy -------------------------------------------------------------------------------------------

def test_a_free_slot_means_no_wait():
    assert estimate_wait(Load(capacity=4, streams=3, queued_cost=0.0)) == 0.0
    assert AdmissionPolicy(0.0).decide(Load(capacity=4, streams=3, queued_cost=0.0)).admit


def test_the_wait_grows_with_the_queued_work_and_refuses_past_the_limit():
    policy = AdmissionPolicy(max_wait_s=2.0)
    waits = [estimate_wait(Load(4, 4, queued, seconds_per_cost=0.01, mean_cost=100.0)) for queued in (0, 400, 800)]
    assert waits == pytest.approx([0.25, 1.25, 2.25])
    assert policy.decide(Load(4, 4, 400, 0.01, 100.0)).admit
    refused = policy.decide(Load(4, 4, 1600, 0.01, 100.0))  # 4.25 s: 2.25 s past the limit
    assert not refused.admit and refused.retry_after_s == 3
    error = refusal("cosyvoice2", refused, 2.0)
    assert isinstance(error, Unavailable) and error.retry_after_s == 3 and "busy" in error.message


def test_the_speed_follows_finished_requests():
    meter = SpeedMeter(initial=0.01, weight=0.5)
    meter.add(cost=100.0, seconds=3.0)
    assert meter.seconds_per_cost == pytest.approx(0.5 * 0.01 + 0.5 * 0.03)


# ---- the cosyvoice2 request pool --------------------------------------------------------------------------

def test_the_pool_refuses_at_once_when_the_queue_would_wait_too_long():
    gate = threading.Event()
    pool = RequestPool(max_workers=1, max_pending=10, name="t", policy=AdmissionPolicy(max_wait_s=0.5))
    pool.speed.seconds_per_cost = 0.01  # a 100-unit request runs 1 s: one queued request waits > 0.5 s
    try:
        first = pool.admit(gate.wait, cost=100.0)
        assert first.admit and first.wait_s == 0.0
        second = pool.admit(gate.wait, cost=100.0)
        assert not second.admit and second.retry_after_s >= 1
        assert pool.refused == 1
    finally:
        gate.set()
        pool.close()


def test_a_request_that_waits_past_the_limit_is_refused_and_never_runs():
    gate = threading.Event()
    pool = RequestPool(max_workers=1, max_pending=10, name="t", policy=AdmissionPolicy(max_wait_s=0.2))
    pool.speed.seconds_per_cost = 1e-6  # the estimate says "no wait": only the expiry can refuse it
    ran, refused = threading.Event(), threading.Event()
    errors = []
    try:
        assert pool.admit(gate.wait).admit
        assert pool.admit(ran.set, on_expired=lambda e: (errors.append(e), refused.set())).admit
        assert refused.wait(10)
        assert isinstance(errors[0], Unavailable) and errors[0].retry_after_s == 1 and "busy" in errors[0].message
        assert pool.waiting == 0 and pool.refused == 1
    finally:
        gate.set()
        pool.close()
    assert not ran.is_set()


def test_closing_the_pool_answers_the_waiting_requests():
    gate, answered = threading.Event(), threading.Event()
    pool = RequestPool(max_workers=1, max_pending=10, name="t", policy=AdmissionPolicy(max_wait_s=60))
    errors = []
    assert pool.admit(gate.wait).admit
    assert pool.admit(lambda: None, on_expired=lambda e: (errors.append(e), answered.set())).admit
    closing = threading.Thread(target=pool.close)
    closing.start()  # waits for the running request, after answering the waiting one
    assert answered.wait(10)
    gate.set()
    closing.join(10)
    assert [(type(e), e.message) for e in errors] == [(Unavailable, "t is shutting down")]
    assert pool.waiting == 0 and not closing.is_alive()


# ---- the gateway's view of a server ----------------------------------------------------------------------

def test_the_gateway_admits_while_a_slot_is_free_and_refuses_a_full_server_with_retry_after():
    from cosyvoice_triton.gateway import admission
    from cosyvoice_triton.errors import Overloaded
    from cosyvoice_triton.gateway.errors import answer_headers, http_status
    from cosyvoice_triton.server_pool import Server
    from cosyvoice_triton.targets import TritonTarget

    server = Server(TritonTarget.parse("grpc://127.0.0.1:1"), client=None, healthy=True)
    policy = AdmissionPolicy(max_wait_s=1.0)
    assert admission.server_load(server, 100.0) is None  # not scraped yet: the server decides
    admission.check(policy, server, 100.0)
    server.slots, server.llm_slots, server.seconds_per_cost = 4, 2, 0.01  # the LLM's 2 slots bind
    server.inflight, server.external = 1, 0.0
    admission.check(policy, server, 100.0)  # one of two slots taken: starts now
    server.external = 5.0  # 6 streams on 2 slots: (4 * 100 + 100) / 2 * 0.01 = 2.5 s
    with pytest.raises(Overloaded) as refused:
        admission.check(policy, server, 100.0)
    assert http_status(refused.value) == 503 and answer_headers(refused.value)["Retry-After"] == "2"
    server.external, server.token2wav_pending = 1.0, 8.0  # slots full, 8 chunks queued in token2wav
    assert admission.decide(policy, server, 100.0).wait_s == pytest.approx((8 * 25.0 + 100.0) / 2 * 0.01)
