"""Admission: whether a synthesis request can start within its deadline, one policy for every entry point.

The cosyvoice2 models apply it to every request they receive (direct gRPC clients and gateways alike, in
`triton.decoupled.RequestPool`); the gateway applies the same function to its view of each server before it
sends a request there (`gateway/admission.py`), so a request that no server can start in time is refused
without a round trip.

A server runs at most `capacity` streams at once (cosyvoice2's workers, or fewer when the LLM has fewer
KV-cache slots); the others wait in its queue, first come first served. Work is priced in cost units
(`request_cost`: the same estimate the gateway routes with). A new request's wait is estimated from the
work queued ahead of it:

    wait_s = 0                                                       while streams < capacity (a slot is free)
    wait_s = (queued_cost + mean_cost) / capacity * seconds_per_cost  otherwise

where streams counts the requests running there and those already waiting (so a burst that arrives before
any worker took a request is not all admitted as "a slot is free"; a request stops counting when its audio
ends, before its final response, and a waiting one whose client left does not count: a client that sends its
next request as soon as the last ended finds a slot free),
and the queued work (requests waiting for a worker; seen from a gateway also requests beyond the LLM's free
KV-cache slots and TOKEN2WAV_CHUNK_COST per chunk waiting in token2wav's queue) plus one request's worth (a running request must end to free a slot), shared by the
`capacity` slots, at the speed measured on finished requests (`SpeedMeter`: seconds of running time per
cost unit, a running mean). A request whose wait_s is more than `max_wait_s` is refused at once:
UNAVAILABLE from Triton, 503 from the gateway, with Retry-After = the time until the queue should have
room again (wait_s - max_wait_s, rounded up, at least 1 s). An admitted request that has not started after
`max_wait_s` all the same (the estimate was wrong) is refused then, before any audio: a queued request's
wait is bounded, never left to a client's timeout.

Streams are admitted in real-time units too (pipeline/capacity.py): their `capacity` is then at most the
streams the server keeps ahead of their listeners (measured audio seconds per second over the real-time
margin), so a stream beyond them waits (priced as above) or is refused, never started and starved.

A refusal is an `Unavailable` error (`refusal`, `expiry`) whose `retry_after_s` carries the seconds as data:
it crosses Triton in the error's JSON (`CosyVoiceError.to_wire`), and a gateway or client reads it back
with `errors.from_wire`; the message says the same in words for people.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from cosyvoice_triton.errors import Unavailable

SPEECH_PER_TEXT_TOKEN = 10.0  # LLM decode steps and token2wav work grow with the output
PROMPT_WEIGHT = 0.5  # per prompt speech token: the LLM's prefill and the flow's attention over the prompt
ENCODE_COST = 25.0  # the prompt encoder runs (a request with raw prompt audio)
BASE_COST = 25.0
MEAN_COST = BASE_COST + 10 * SPEECH_PER_TEXT_TOKEN  # a typical request, before any is seen
TOKEN2WAV_CHUNK_COST = 25.0  # a chunk waiting in token2wav's queue: about 25 speech tokens of work
DEFAULT_SECONDS_PER_COST = 0.01  # before any request has finished: 1.25 s for a typical request
DEFAULT_MAX_WAIT_S = 2.0


def request_cost(text_tokens: int, prompt_tokens: int = 0, encodes_prompt: bool = False) -> float:
    """A request's cost units ("speech-token steps")."""
    return (SPEECH_PER_TEXT_TOKEN * text_tokens + PROMPT_WEIGHT * prompt_tokens
            + (ENCODE_COST if encodes_prompt else 0.0) + BASE_COST)


def text_tokens_estimate(text: str) -> int:
    """Text tokens without a tokenizer: about 4 UTF-8 bytes a token."""
    return max(1, len(text.encode("utf-8")) // 4)


@dataclass(frozen=True)
class Load:
    """What a server has now: its streams (running and waiting), the cost of the waiting work, its speed."""

    capacity: int
    streams: int  # running + waiting
    queued_cost: float
    seconds_per_cost: float = DEFAULT_SECONDS_PER_COST
    mean_cost: float = MEAN_COST


@dataclass(frozen=True)
class Decision:
    admit: bool
    wait_s: float  # the estimated wait before the request starts
    retry_after_s: int  # refused: when to try again


def estimate_wait(load: Load) -> float:
    """Seconds before a new request would start (see the module docstring)."""
    if load.streams < load.capacity:
        return 0.0
    return (load.queued_cost + load.mean_cost) / max(1, load.capacity) * load.seconds_per_cost


@dataclass(frozen=True)
class AdmissionPolicy:
    max_wait_s: float = DEFAULT_MAX_WAIT_S

    def decide(self, load: Load) -> Decision:
        wait_s = estimate_wait(load)
        if wait_s <= self.max_wait_s:
            return Decision(True, wait_s, 0)
        return Decision(False, wait_s, max(1, math.ceil(wait_s - self.max_wait_s)))


def refusal(who: str, decision: Decision, max_wait_s: float) -> Unavailable:
    """The error that refuses a request at once: it would wait more than `max_wait_s` to start."""
    return Unavailable(f"{who} is busy: a new request would wait about {decision.wait_s:.1f} s to start (the "
                       f"limit is {max_wait_s:g} s); retry after {decision.retry_after_s} s",
                       retry_after_s=decision.retry_after_s)


def expiry(who: str, waited_s: float) -> Unavailable:
    """The error that refuses an admitted request that has waited its limit without starting."""
    return Unavailable(f"{who} is busy: the request waited {waited_s:.1f} s without starting; retry after 1 s",
                       retry_after_s=1)


class SpeedMeter:
    """Seconds of running time per cost unit, a running mean over finished requests (thread-safe)."""

    def __init__(self, initial: float = DEFAULT_SECONDS_PER_COST, weight: float = 0.2):
        self.seconds_per_cost = initial
        self.mean_cost = MEAN_COST
        self._weight = weight
        self._lock = threading.Lock()

    def add(self, cost: float, seconds: float) -> None:
        if cost <= 0 or seconds < 0:
            return
        with self._lock:
            w = self._weight
            self.seconds_per_cost = (1 - w) * self.seconds_per_cost + w * seconds / cost
            self.mean_cost = (1 - w) * self.mean_cost + w * cost
