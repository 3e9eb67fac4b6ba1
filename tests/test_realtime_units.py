"""Admission in real-time units without Triton: the capacity meter (pipeline/capacity.py), the request pool
that starts streams only while every running one stays ahead, and the gateway's view and routing by the same
measure. Times come from a hand-driven clock; no test depends on the machine's speed."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from cosyvoice_triton.admission import AdmissionPolicy
from cosyvoice_triton.pipeline.capacity import COLD_STREAMS, Capacity, realtime_slots
from cosyvoice_triton.triton.decoupled import RequestPool

RATE = 24000


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chunk(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def play(capacity: Capacity, clock: Clock, schedule: list[tuple[float, float]]) -> None:
    """One stream: (wall seconds before the chunk, audio seconds in it) for each chunk."""
    def chunks():
        for wait, seconds in schedule:
            clock.now += wait
            yield chunk(seconds)
    for _ in capacity.watch(chunks()):
        pass


# ---- slots and the estimate ----------------------------------------------------------------------------------

def test_real_time_slots_are_the_capacity_over_the_margin_within_one_and_the_workers():
    assert realtime_slots(3.0, 1.2, 16) == 2
    assert realtime_slots(2.4, 1.2, 16) == 2  # exactly at the margin counts
    assert realtime_slots(0.5, 1.2, 16) == 1  # a slow server still runs one stream
    assert realtime_slots(100.0, 1.2, 16) == 16  # never more than its workers
    assert realtime_slots(0.5, 0.0, 16) == 16  # margin 0: off


def test_a_cold_server_uses_the_default_until_measured_then_what_it_made():
    clock = Clock()
    capacity = Capacity(margin=1.2, clock=clock, measured_after_s=2.0)
    assert not capacity.measured and capacity.estimate() == pytest.approx(COLD_STREAMS * 1.2)
    play(capacity, clock, [(0.5, 2.0)] * 6)  # 3 busy seconds, 12 s of audio: 4x real time
    assert capacity.measured and capacity.estimate() == pytest.approx(4.0, rel=0.05)
    clock.now += 600  # idle time ages nothing
    assert capacity.estimate() == pytest.approx(4.0, rel=0.05)
    assert capacity.slots(16) == 3


def test_a_forced_capacity_is_never_replaced():
    clock = Clock()
    capacity = Capacity(margin=1.2, forced=1.5, clock=clock)
    play(capacity, clock, [(0.5, 2.0)] * 10)
    assert capacity.estimate() == 1.5 and capacity.slots(16) == 1 and not capacity.measured


# ---- the listeners -----------------------------------------------------------------------------------------

def test_a_stream_ahead_of_its_listener_is_not_starved():
    clock = Clock()
    capacity = Capacity(clock=clock)
    play(capacity, clock, [(0.2, 0.5), (0.4, 1.0), (0.8, 1.0), (0.8, 1.0)])
    assert (capacity.starved, capacity.stall_s) == (0, 0.0)
    assert capacity.open_streams == 0


def test_a_listener_that_runs_dry_counts_its_stream_once_and_every_stall():
    clock = Clock()
    capacity = Capacity(clock=clock, start_buffer_s=0.3)
    # first 0.5 s plays 0.3 .. 0.8 after it; the next chunk comes at 1.5 (0.7 s dry), the third 1 s later
    # with 0.5 s of audio left (0.5 s dry)
    play(capacity, clock, [(0.0, 0.5), (1.5, 0.5), (1.0, 0.5)])
    assert capacity.starved == 1
    assert capacity.stall_s == pytest.approx(0.7 + 0.5)
    play(capacity, clock, [(0.0, 0.5), (0.82, 0.5)])  # 20 ms dry: below the tolerance
    assert capacity.starved == 1


def test_what_is_not_audio_passes_through_uncounted():
    clock = Clock()
    capacity = Capacity(clock=clock)
    mark = object()  # e.g. a speech mark event among the chunks
    assert [type(c) for c in capacity.watch(iter([chunk(0.5), mark]))] == [np.ndarray, object]
    assert capacity.starved == 0 and capacity.open_streams == 0


def test_a_running_stream_whose_listener_waits_now_is_stalled():
    clock = Clock()
    capacity = Capacity(clock=clock, start_buffer_s=0.0)
    release = threading.Event()

    def chunks():
        yield chunk(1.0)
        release.wait(10)
        yield chunk(1.0)

    stream = capacity.watch(chunks())
    next(stream)
    assert not capacity.stalled()
    clock.now += 1.5  # its 1 s of audio has run out
    assert capacity.stalled()
    release.set()
    list(stream)
    assert not capacity.stalled() and capacity.open_streams == 0


def test_listeners_holding_enough_audio_carry_the_margin_so_one_more_stream_may_start():
    clock = Clock()
    capacity = Capacity(margin=1.2, clock=clock, measured_after_s=1.0, start_buffer_s=0.0)
    play(capacity, clock, [(0.5, 1.0)] * 4)  # 2x real time: floor(2 / 1.2) = 1 stream at the margin
    assert capacity.slots(16) == 1

    def short_chunks():
        clock.now += 0.5
        yield chunk(1.0)  # still 2x real time; its listener holds 1 s

    short = capacity.watch(short_chunks())
    next(short)
    assert capacity.slots(16) == 1  # its listener holds 1 s: below BUFFERED_MARGIN_S, the margin counts
    list(short)

    held = threading.Event()

    def buffered():
        clock.now += 1.5
        yield chunk(3.0)  # still 2x real time; 3 s of audio, more than BUFFERED_MARGIN_S, ahead of its listener
        held.wait(10)

    long = capacity.watch(buffered())
    next(long)
    assert capacity.slots(16) == 2
    held.set()
    list(long)


# ---- the pool -------------------------------------------------------------------------------------------------

def test_the_pool_runs_only_its_real_time_slots_and_starts_the_next_when_one_ends():
    capacity = Capacity(margin=1.2, forced=1.5)  # one stream kept ahead
    pool = RequestPool(max_workers=4, max_pending=10, name="t", policy=AdmissionPolicy(max_wait_s=60),
                       capacity=capacity)
    gate, second_ran = threading.Event(), threading.Event()
    started = []
    try:
        assert pool.slots() == 1
        first = pool.admit(lambda: (started.append(1), gate.wait(10)), cost=100.0)
        second = pool.admit(lambda: (started.append(2), second_ran.set()), cost=100.0)
        assert first.admit and first.wait_s == 0.0
        assert second.admit and second.wait_s > 0  # admitted to wait: the one slot is taken
        assert not second_ran.wait(0.3) and pool.waiting == 1 and started == [1]
        gate.set()
        assert second_ran.wait(10) and started == [1, 2]
    finally:
        gate.set()
        pool.close()


def test_the_pool_refuses_a_stream_that_would_wait_past_the_limit():
    pool = RequestPool(max_workers=4, max_pending=10, name="t", policy=AdmissionPolicy(max_wait_s=0.5),
                       capacity=Capacity(margin=1.2, forced=1.5))
    pool.speed.seconds_per_cost = 0.01  # a 100-unit stream runs 1 s
    gate = threading.Event()
    try:
        assert pool.admit(gate.wait, cost=100.0).admit
        refused = pool.admit(gate.wait, cost=100.0)
        assert not refused.admit and refused.retry_after_s >= 1 and pool.refused == 1
    finally:
        gate.set()
        pool.close()


def test_margin_zero_keeps_cost_based_admission():
    pool = RequestPool(max_workers=4, max_pending=10, name="t", capacity=Capacity(margin=0.0, forced=0.5))
    try:
        assert pool.slots() == 4
    finally:
        pool.close()


# ---- the gateway's view ---------------------------------------------------------------------------------------

def _server(**fields):
    from cosyvoice_triton.server_pool import Server
    from cosyvoice_triton.targets import TritonTarget

    server = Server(TritonTarget.parse(f"grpc://127.0.0.1:{fields.pop('port', 1)}"), client=None, healthy=True)
    for key, value in fields.items():
        setattr(server, key, value)
    return server


def test_the_gateway_counts_real_time_slots_and_records_the_queue_place():
    from cosyvoice_triton.gateway import admission
    from cosyvoice_triton.errors import Overloaded
    from cosyvoice_triton.gateway.errors import answer_headers, http_status

    policy = AdmissionPolicy(max_wait_s=2.0)
    server = _server(slots=16, llm_slots=8, realtime_slots=2, seconds_per_cost=0.01, inflight=1)
    assert admission.server_load(server, 100.0).capacity == 2  # the real-time slots bind
    admission.check(policy, server, 100.0)
    assert admission.QUEUE_PLACE.get() == admission.QueuePlace(0, 0.0)  # a slot is free: starts at once
    seen = []
    admission.ON_QUEUED.set(seen.append)
    server.external = 2.0  # 3 streams on 2 slots: this one is second in line
    admission.check(policy, server, 100.0)
    place = admission.QUEUE_PLACE.get()
    assert place.position == 2 and place.expected_start_s == pytest.approx((100.0 + 100.0) / 2 * 0.01)
    assert seen == [place]
    server.external = 5.0  # (4 * 100 + 100) / 2 * 0.01 = 2.5 s > 2 s
    with pytest.raises(Overloaded) as refused:
        admission.check(policy, server, 100.0)
    assert http_status(refused.value) == 503 and answer_headers(refused.value)["Retry-After"] == "1"


def test_routing_avoids_a_server_without_real_time_room_and_weighs_cost_by_capacity():
    from cosyvoice_triton.gateway.routing import capacity_view, realtime_load

    full = _server(port=1, realtime_slots=2, inflight=2, capacity=10.0)
    room = _server(port=2, realtime_slots=4, inflight=3, capacity=5.0)
    assert realtime_load(full, 10.0, True) > realtime_load(room, 100.0, True)  # full loses whatever its cost
    fast = _server(port=3, realtime_slots=8, capacity=8.0)
    slow = _server(port=4, realtime_slots=8, capacity=2.0)
    assert realtime_load(fast, 300.0, True) < realtime_load(slow, 100.0, True)  # 37.5 vs 50 s of work
    assert realtime_load(fast, 300.0, False) > realtime_load(slow, 100.0, False)  # capacities unknown: cost
    view = capacity_view([full, _server(port=5)])
    assert list(view) == [full.name] and view[full.name]["realtime_slots"] == 2


# ---- the dashboard and the alert ----------------------------------------------------------------------------

def test_the_alert_fires_on_a_starved_stream_and_uses_only_exported_metrics():
    from pathlib import Path

    import yaml
    from test_deploy_manifests import exported_metrics, promql_metric_names

    rule_file = yaml.safe_load((Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "alerts.yaml").read_text())
    assert rule_file["kind"] == "PrometheusRule" and rule_file["apiVersion"] == "monitoring.coreos.com/v1"
    rules = {r["alert"]: r for group in rule_file["spec"]["groups"] for r in group["rules"]}
    exported = exported_metrics()
    for rule in rules.values():
        assert not promql_metric_names(rule["expr"]) - exported, rule["expr"]
    starved = rules["CosyVoiceStreamStarved"]
    assert "cosyvoice_starved_streams_total" in starved["expr"] and starved["expr"].endswith("> 0")
    assert "for" not in starved  # any starved stream, at once
    dashboard = (Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "cosyvoice.json").read_text()
    for name in ("cosyvoice_capacity_audio_seconds_per_second", "cosyvoice_starved_streams_total",
                 "cosyvoice_stall_seconds_total", "cosyvoice_queue_wait_seconds_bucket", "cosyvoice_queued_streams"):
        assert name in dashboard, name


def test_a_non_streamed_request_keeps_cost_based_admission_at_the_gateway():
    from cosyvoice_triton.gateway import admission

    server = _server(slots=16, llm_slots=8, realtime_slots=2, seconds_per_cost=0.01, inflight=3)
    assert admission.server_load(server, 100.0).capacity == 2
    assert admission.server_load(server, 100.0, streamed=False).capacity == 8  # no listener: cost only
    admission.check(AdmissionPolicy(max_wait_s=0.1), server, 100.0, streamed=False)  # a free slot by cost
    assert admission.QUEUE_PLACE.get() == admission.QueuePlace(0, 0.0)
