"""The gateway's admission: the library's policy (cosyvoice_triton/admission.py) applied to its view of a
server before a request goes there, so that a request no server can start in time gets 503 + Retry-After
at once instead of a place in a queue it would time out in.

A server's load, as this gateway sees it (`server_load`):
  capacity      its cosyvoice2 stream slots (`cosyvoice_stream_slots`), fewer when the LLM has fewer KV-cache
                slots (`cosyvoice_llm_free_slots` + `cosyvoice_llm_active_streams`)
  streams       this gateway's requests in flight there now, plus the others' (`Server.external`: running,
                queued and pending there at the last scrape, less this gateway's); fewer than the capacity:
                a slot is free and the request starts now
  queued_cost   the streams beyond the capacity, at the mean request cost, plus TOKEN2WAV_CHUNK_COST for
                each chunk waiting in token2wav's queue (`nv_inference_pending_request_count{model=token2wav}`)
  speed         the server's measured `cosyvoice_seconds_per_cost`
Until a server's metrics were scraped once (slots 0) the gateway admits and lets the server decide: the
cosyvoice2 model applies the same policy to everything it receives, and its refusal (an Unavailable error
whose `retry_after_s` crosses Triton as data) comes back as the same 503 with the same Retry-After.
"""
from __future__ import annotations

from cosyvoice_triton.admission import (
    DEFAULT_SECONDS_PER_COST,
    TOKEN2WAV_CHUNK_COST,
    AdmissionPolicy,
    Decision,
    Load,
)
from cosyvoice_triton.server_pool import Server

from .errors import Overloaded


def server_load(server: Server, mean_cost: float) -> Load | None:
    """What `server` has now, or None before its first scrape."""
    if server.slots <= 0:
        return None
    capacity = min(server.slots, server.llm_slots) if server.llm_slots > 0 else server.slots
    streams = server.inflight + server.external
    queued_cost = max(0.0, streams - capacity) * mean_cost + server.token2wav_pending * TOKEN2WAV_CHUNK_COST
    return Load(capacity=capacity, streams=int(streams), queued_cost=queued_cost,
                seconds_per_cost=server.seconds_per_cost or DEFAULT_SECONDS_PER_COST, mean_cost=mean_cost)


def decide(policy: AdmissionPolicy, server: Server, mean_cost: float) -> Decision:
    load = server_load(server, mean_cost)
    return Decision(True, 0.0, 0) if load is None else policy.decide(load)


def check(policy: AdmissionPolicy, server: Server, mean_cost: float) -> None:
    """Raise Overloaded (503 + Retry-After) when a request sent to `server` now would not start in time."""
    decision = decide(policy, server, mean_cost)
    if not decision.admit:
        raise Overloaded(f"every server is busy: a new request would wait about {decision.wait_s:.1f} s to "
                         f"start (the limit is {policy.max_wait_s:g} s); retry after {decision.retry_after_s} s",
                         decision.retry_after_s)
