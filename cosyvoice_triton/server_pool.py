"""The servers a process may send work to: health, least outstanding work, join and leave.

Pure bookkeeping, no I/O: the caller does the calls, health checks, metric scrapes and DNS lookups (with
asyncio in the gateway's `Router`, with threads in the split frontend's `RemoteToken2Wav`) and tells the
pool what it saw. A caller that shares the pool between threads holds its own lock around every call.

- `pick` chooses the healthy server with the least load, ties to the one picked least recently. A
  server's load is this process's outstanding cost there plus the work others sent it (`external`,
  from its metrics, in requests) times the mean request cost.
- `acquire` / `release` count a request's cost against its server while it runs.
- `set_health` takes a server out of rotation or puts it back; its scraped load is forgotten either way
  (it described a server that was down).
- `update(spec, found)` applies what a `dns://` spec resolves to now: new addresses join (healthy or not,
  as the pool was made), addresses gone from it leave at once: out of rotation and of `servers`, kept in
  `draining` while requests still run there. Fixed servers (no spec) never leave. An empty answer keeps
  the spec's servers: a DNS hiccup must not empty the pool.
- A server that left is idle once its last request ends: `release` (or `update`) returns it, for the
  caller to close its channel.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cosyvoice_triton.targets import TritonTarget


@dataclass(eq=False)
class Server:
    """One server of a pool and what the pool knows about it."""

    target: TritonTarget
    client: Any  # what the caller talks to it with (a gRPC channel's client); the pool never uses it
    healthy: bool = False
    source: str | None = None  # the dns:// spec that found it; None: a fixed server, which never leaves
    family: str | None = None  # the model family it serves, as the caller's health check learned it; None: not yet
    outstanding_cost: float = 0.0  # this process's requests in flight there, by cost
    inflight: int = 0  # this process's requests in flight there
    external: float = 0.0  # requests there that this process did not send (last scrape)
    pending: float = 0.0  # requests queued in the server (last scrape)
    # For admission (cosyvoice_triton/admission.py), from the last scrape; slots 0: not scraped yet
    slots: int = 0  # streams its cosyvoice2 instances run at once
    queued: float = 0.0  # requests admitted there, waiting for a worker
    seconds_per_cost: float | None = None  # its measured speed
    llm_slots: int = 0  # the LLM's KV-cache slots (free + used); 0: unknown
    llm_free_slots: int = 0
    token2wav_pending: float = 0.0  # chunk requests waiting in token2wav's queue
    capacity: float = 0.0  # audio seconds per second it makes, all streams (pipeline/capacity.py); 0: unknown
    capacity_measured: bool = False  # False: its cold default (or forced)
    realtime_slots: int = 0  # streams it keeps ahead of their listeners; 0: unknown
    precision: dict = field(default_factory=dict)  # {"llm": ..., "flow": ...} as its metrics say (/readyz)
    last_pick: int = 0
    leaving: bool = False  # gone from its spec: out of the pool, closed once `inflight` is 0

    @property
    def name(self) -> str:
        return self.target.name


@dataclass(frozen=True)
class Update:
    """What one `update` changed."""

    joined: list[Server]
    left: list[Server]
    idle: list[Server]  # of those that left, the ones with nothing running: close them now


class ServerPool:
    def __init__(self, servers: Iterable[Server] = (), *, mean_cost: float = 1.0, joins_healthy: bool = False):
        self.servers: list[Server] = list(servers)  # in the pool: fixed, and discovered while DNS names them
        self.draining: list[Server] = []  # left, with requests still running there
        self.mean_cost = mean_cost  # running mean of request costs: the cost of one `external` request
        self.joins_healthy = joins_healthy  # a discovered server takes work before its first health check
        self._picks = itertools.count(1)

    # ---- choosing ------------------------------------------------------------------------------------
    def load(self, server: Server) -> float:
        return server.outstanding_cost + server.external * self.mean_cost

    def healthy(self) -> list[Server]:
        return [s for s in self.servers if s.healthy]

    def pick(self, exclude: Iterable[Server] = (), load: Callable[[Server], Any] | None = None) -> Server | None:
        """The healthy server with the least load (`load`, default `self.load`; not in `exclude`), or None."""
        excluded = set(exclude)
        candidates = [s for s in self.servers if s.healthy and s not in excluded]
        if not candidates:
            return None
        load = load or self.load
        chosen = min(candidates, key=lambda s: (load(s), s.last_pick))
        chosen.last_pick = next(self._picks)
        return chosen

    def acquire(self, server: Server, cost: float = 1.0) -> None:
        """Count a request of `cost` against `server` until `release`."""
        self.mean_cost = 0.9 * self.mean_cost + 0.1 * cost
        server.outstanding_cost += cost
        server.inflight += 1

    def release(self, server: Server, cost: float = 1.0) -> bool:
        """The request ended. True when `server` left the pool and now has nothing running: close it."""
        server.outstanding_cost = max(0.0, server.outstanding_cost - cost)
        server.inflight -= 1
        if server.leaving and server.inflight == 0 and server in self.draining:
            self.draining.remove(server)
            return True
        return False

    # ---- health -------------------------------------------------------------------------------------------
    def set_health(self, server: Server, healthy: bool) -> bool:
        """Take `server` out of rotation or put it back; True when that changed anything."""
        if server.healthy == healthy or server.leaving:
            return False
        server.healthy = healthy
        server.external = server.pending = server.queued = server.token2wav_pending = 0.0
        server.slots = server.llm_slots = server.llm_free_slots = server.realtime_slots = 0
        server.seconds_per_cost = None
        server.capacity, server.capacity_measured = 0.0, False
        return True

    def set_external(self, server: Server, active: float) -> None:
        """The server reports `active` requests in all: those beyond this process's are others'."""
        server.external = max(0.0, active - server.inflight)

    # ---- membership ---------------------------------------------------------------------------------------
    def update(self, spec: str, found: Sequence[TritonTarget], new_client: Callable[[TritonTarget], Any]) -> Update:
        """Make the pool's servers from `spec` the ones at `found` (nothing found: no change)."""
        if not found:
            return Update([], [], [])
        left = [s for s in self.servers if s.source == spec and s.target not in found]
        idle = [s for s in left if self._leave(s)]
        members = {s.target for s in self.servers}  # an address already there (fixed, another spec) stays one
        joined = [Server(t, new_client(t), healthy=self.joins_healthy, source=spec)
                  for t in dict.fromkeys(found) if t not in members]
        self.servers.extend(joined)
        return Update(joined, left, idle)

    def _leave(self, server: Server) -> bool:
        """Out of the pool; True when nothing runs there (close it now), else it drains."""
        self.servers.remove(server)
        server.leaving, server.healthy = True, False
        if server.inflight == 0:
            return True
        self.draining.append(server)
        return False

    def everyone(self) -> list[Server]:
        """Members and draining servers: every server whose channel is open."""
        return [*self.servers, *self.draining]
