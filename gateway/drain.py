"""Draining a gateway before it stops (docs/operations/faults.md): `drain.begin(reason)` refuses new requests and new
syntheses in open sessions (`Draining`: 503 + Retry-After) while /healthz, /readyz and /metrics keep answering, and
`wait_idle` waits for what is in flight (HTTP requests, the router's Triton calls, accepted WebSocket segments),
never for an idle WebSocket.
"""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from cosyvoice_triton.errors import Draining

ALWAYS_SERVED = frozenset({"/healthz", "/readyz", "/metrics"})
IDLE_CHECK_S = 0.1
DRAIN_TIMEOUT_S = 20.0  # how long the requests in flight at SIGTERM may take to finish
CUT_AFTER_DRAIN_S = 2.0  # aiohttp's shutdown timeout once the grace period is over


class Drain:
    def __init__(self) -> None:
        self.reason: str | None = None  # set once draining
        # HTTP requests being handled (not ALWAYS_SERVED) + WebSocket segments accepted and not yet sent
        self.in_flight = 0

    @property
    def draining(self) -> bool:
        return self.reason is not None

    def begin(self, reason: str) -> None:
        self.reason = reason

    def refuse_new(self) -> None:
        """Raise `Draining` once draining: no new request or synthesis is taken."""
        if self.reason is not None:
            raise Draining(f"{self.reason}: no new requests are taken; retry on another instance")

    def busy(self, router) -> int:
        """Requests still in flight: HTTP handlers plus the router's Triton calls."""
        return self.in_flight + sum(server.inflight for server in router.servers)

    async def wait_idle(self, router, grace_s: float) -> bool:
        """Wait until nothing is in flight (True) or `grace_s` passed (False)."""
        deadline = time.monotonic() + grace_s
        while self.busy(router):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(IDLE_CHECK_S)
        return True

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.path in ALWAYS_SERVED:
            return await handler(request)
        self.refuse_new()
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await handler(request)  # its streams count through the router
        self.in_flight += 1
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1


def drain_readiness(drain: Drain) -> tuple[list[str], dict]:
    """A READINESS_CHECKS entry: not ready once draining, and /readyz says "draining" with the reason."""
    if not drain.draining:
        return [], {}
    return [f"nothing: {drain.reason}"], {"status": "draining", "draining": drain.reason}
