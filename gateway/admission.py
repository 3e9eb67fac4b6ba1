"""The gateway's admission: the library's policy (cosyvoice_triton/admission.py) applied to its view of a server
before a request goes there, so that a request no server can start in time gets 503 + Retry-After at once, and a
refusal that rests on other clients' streams is decided on a fresh scrape. A request admitted to wait gets its
place in the queue (`QueuePlace`). How a server's load is read:
docs/operations/overload.md#how-the-gateway-picks-a-server.
"""
from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, replace

from aiohttp import web

from cosyvoice_triton.errors import Overloaded
from cosyvoice_triton.admission import (
    DEFAULT_SECONDS_PER_COST,
    TOKEN2WAV_CHUNK_COST,
    AdmissionPolicy,
    Decision,
    Load,
    estimate_wait,
)
from cosyvoice_triton.server_pool import Server


QUEUE_POSITION_HEADER, EXPECTED_START_HEADER = "X-Queue-Position", "X-Expected-Start-S"


@dataclass(frozen=True)
class QueuePlace:
    position: int  # 1: the next to start; 0: started at once
    expected_start_s: float  # admission's estimate of the wait


QUEUE_PLACE: ContextVar[QueuePlace | None] = ContextVar("queue_place", default=None)  # this request's, if checked
ON_QUEUED: ContextVar[Callable[[QueuePlace], None] | None] = ContextVar("on_queued", default=None)


def server_load(server: Server, mean_cost: float, streamed: bool = True) -> Load | None:
    """What `server` has now, or None before its first scrape. Not `streamed` (the whole audio at once: nobody
    listens while it runs): cost-based, its real-time slots do not count."""
    if server.slots <= 0:
        return None
    realtime_slots = server.realtime_slots if streamed else 0
    capacity = min(s for s in (server.slots, server.llm_slots, realtime_slots) if s > 0)
    streams = server.inflight + server.external
    queued_cost = max(0.0, streams - capacity) * mean_cost + server.token2wav_pending * TOKEN2WAV_CHUNK_COST
    return Load(capacity=capacity, streams=int(streams), queued_cost=queued_cost,
                seconds_per_cost=server.seconds_per_cost or DEFAULT_SECONDS_PER_COST, mean_cost=mean_cost)


def queue_place(load: Load | None) -> QueuePlace:
    """Where a new request would wait on a server with `load` (position 0: it starts at once)."""
    if load is None or load.streams < load.capacity:
        return QueuePlace(0, 0.0)
    return QueuePlace(load.streams - load.capacity + 1, estimate_wait(load))


def decide(policy: AdmissionPolicy, server: Server, mean_cost: float, streamed: bool = True) -> Decision:
    load = server_load(server, mean_cost, streamed)
    return Decision(True, 0.0, 0) if load is None else policy.decide(load)


def check(policy: AdmissionPolicy, server: Server, mean_cost: float, streamed: bool = True) -> None:
    """Raise Overloaded (503 + Retry-After) when a request sent to `server` now would not start in time; else
    record its place in the server's queue (`QUEUE_PLACE`, and `ON_QUEUED` when it waits)."""
    decision = decide(policy, server, mean_cost, streamed)
    if not decision.admit:
        raise Overloaded(f"every server is busy: a new request would wait about {decision.wait_s:.1f} s to "
                         f"start (the limit is {policy.max_wait_s:g} s); retry after {decision.retry_after_s} s",
                         retry_after_s=decision.retry_after_s)
    place = queue_place(server_load(server, mean_cost, streamed))
    QUEUE_PLACE.set(place)
    on_queued = ON_QUEUED.get()
    if place.position > 0 and on_queued is not None:
        on_queued(place)


async def check_fresh(policy: AdmissionPolicy, router, server: Server, mean_cost: float, streamed: bool = True) -> None:
    """`check`, with a refusal decided on a fresh view: when the last scrape says no, `router.refresh(server)`
    scrapes it again first. The others' streams counted there (`Server.external`) are as old as the scrape, up
    to a scrape interval: a client that sends its next request through the gateway as soon as its stream
    straight to Triton ended would otherwise be refused by a quiet server. Only a refusal that rests on those
    streams waits for a scrape: one this gateway's own requests there decide is given at once."""
    refused = not decide(policy, server, mean_cost, streamed).admit
    if refused and decide(policy, replace(server, external=0.0), mean_cost, streamed).admit:
        await router.refresh(server)
    check(policy, server, mean_cost, streamed)


@web.middleware
async def queue_place_middleware(request: web.Request, handler):
    """Each request starts without a place (a connection's task serves its requests one after another)."""
    QUEUE_PLACE.set(None)
    return await handler(request)


async def add_queue_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: a request that admission checked carries its place in the queue."""
    place = QUEUE_PLACE.get()
    if place is not None:  # (headers may still change here: they are written after this signal)
        response.headers[QUEUE_POSITION_HEADER] = str(place.position)
        response.headers[EXPECTED_START_HEADER] = f"{place.expected_start_s:.2f}"
