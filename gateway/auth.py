"""API keys, tenants, and the per-key limits: concurrent streams and request / registration rates.

Every request runs as a `Tenant` (its key's owner tag, never the key itself); limits answer 429 with
`Retry-After` and say which limit. Keys, tenants and limits: docs/operations/tenants.md.
"""
from __future__ import annotations

import contextvars
import hmac
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from aiohttp import web

from cosyvoice_triton.errors import RateLimited, TooManyStreams, Unauthorized
from cosyvoice_triton.voices.store import owner_tag

from .request_keys import API_KEY, TENANT

PUBLIC_PATHS = frozenset({"/", "/healthz", "/readyz", "/metrics", "/favicon.ico"})
WEBSOCKET_PATH = "/v1/tts/ws"  # the one route that accepts ?api_key=
KEYLESS = "keyless"  # the limit bucket of keyless use


@dataclass(frozen=True)
class Tenant:
    owner: str | None  # owner tag of the key; None: keyless use
    admin: bool  # an admin key: may register and delete shared voices
    bucket: str  # what its stream and rate limits count in

    @property
    def keyed(self) -> bool:
        return self.owner is not None

    def describe(self) -> str:
        return "per API key" if self.keyed else "for keyless use (all callers together)"


KEYLESS_TENANT = Tenant(owner=None, admin=False, bucket=KEYLESS)
_CURRENT: contextvars.ContextVar[Tenant] = contextvars.ContextVar("tenant")


def current_tenant() -> Tenant:
    """The tenant of the request being handled (set by the auth middleware). LookupError outside one."""
    return _CURRENT.get()


@dataclass(frozen=True)
class ApiKeys:
    keys: frozenset[str] = frozenset()  # ordinary keys
    admin: frozenset[str] = frozenset()  # admin keys (valid keys too)

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.admin)

    def tenant(self, key: str | None) -> Tenant:
        """The tenant of a presented key; Unauthorized if keys are on and it is missing or wrong."""
        if not self.enabled:
            return KEYLESS_TENANT
        if key is None:
            raise Unauthorized()
        given = key.encode()
        # compare_digest against every key: no early exit on a match or a near match
        is_admin = any([hmac.compare_digest(given, k.encode()) for k in self.admin])
        is_key = any([hmac.compare_digest(given, k.encode()) for k in self.keys])
        if not (is_admin or is_key):
            raise Unauthorized("the API key is not valid")
        owner = owner_tag(key)
        return Tenant(owner=owner, admin=is_admin, bucket=f"key:{owner}")


def header_key(headers) -> str | None:
    """The key in `Authorization: Bearer KEY` or `X-API-Key: KEY` (HTTP headers, or a gRPC call's metadata)."""
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("X-API-Key")


def presented_key(request: web.Request) -> str | None:
    key = header_key(request.headers)
    if key is not None:
        return key
    if "api_key" in request.query and request.path != WEBSOCKET_PATH:
        raise Unauthorized("?api_key= is accepted only on the WebSocket route; send the key in a header "
                           "(Authorization: Bearer KEY or X-API-Key)")
    return request.query.get("api_key")


def auth_middleware(keys: ApiKeys | frozenset[str], rates: RateLimiter | None = None):
    """Authenticates every non-public request, sets its tenant, and counts it against the request rate."""
    if not isinstance(keys, ApiKeys):
        keys = ApiKeys(keys=frozenset(keys))

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path in PUBLIC_PATHS or request.path.startswith("/static/"):
            return await handler(request)
        key = presented_key(request) if keys.enabled else None
        tenant = keys.tenant(key)
        if tenant.keyed:
            request[API_KEY] = key
        request[TENANT] = tenant
        if rates is not None:
            rates.take(tenant)
        token = _CURRENT.set(tenant)
        try:
            return await handler(request)
        finally:
            _CURRENT.reset(token)

    return middleware


def limit_key(request: web.Request) -> str:
    """The bucket of the request's stream limit (its tenant's)."""
    tenant = request.get(TENANT, KEYLESS_TENANT)
    return tenant.bucket


class StreamLimiter:
    """At most `limit` concurrent streams per key, and `keyless_limit` for all keyless use together
    (429 beyond)."""

    def __init__(self, limit: int, keyless_limit: int | None = None):
        self.limit = limit
        self.keyless_limit = limit if keyless_limit is None else keyless_limit
        self._counts: dict[str, int] = defaultdict(int)

    def limit_of(self, key: str) -> int:
        return self.keyless_limit if key == KEYLESS else self.limit

    @contextmanager
    def slot(self, key: str) -> Iterator[None]:
        limit = self.limit_of(key)
        if self._counts[key] >= limit:
            scope = "for keyless use (all callers together)" if key == KEYLESS else "per API key"
            raise TooManyStreams(f"at most {limit} concurrent streams {scope}; wait for one to end")
        self._counts[key] += 1
        token = HELD_SLOT.set((self, key))
        try:
            yield
        finally:
            HELD_SLOT.reset(token)
            self._release(key)

    def _release(self, key: str) -> None:
        self._counts[key] -= 1
        if self._counts[key] <= 0:
            del self._counts[key]

    def active(self, key: str) -> int:
        return self._counts.get(key, 0)


# The stream slot the current request holds (set by `StreamLimiter.slot`), for `slot_set_aside`.
HELD_SLOT: contextvars.ContextVar[tuple[StreamLimiter, str] | None] = contextvars.ContextVar("held_slot", default=None)


@contextmanager
def slot_set_aside() -> Iterator[None]:
    """While the current request waits to be admitted (admission's fresh scrape), it is not a stream yet: its
    slot is free for others meanwhile and taken back after without the limit (it was within it). Otherwise a
    burst of requests that are about to be refused would hold every slot and turn the rest away with 429."""
    held = HELD_SLOT.get()
    if held is None:
        yield
        return
    limiter, key = held
    limiter._release(key)
    try:
        yield
    finally:
        limiter._counts[key] += 1


class TokenBucket:
    """`rate` tokens a second up to `burst`; `take()` returns 0 when a token was taken, else the seconds
    until one is there."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.stamp = burst, clock()

    def take(self) -> float:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def full(self) -> bool:
        return self.tokens + (self.clock() - self.stamp) * self.rate >= self.burst


class RateLimiter:
    """A token bucket per tenant bucket: `count` per `period_s` seconds, bursts of `burst`; `count` <= 0
    turns it off. `what` names it in the 429."""

    MAX_BUCKETS = 10_000  # full (idle) buckets are dropped beyond this
    PERIODS = {1.0: "second", 60.0: "minute", 3600.0: "hour"}

    def __init__(self, count: float, period_s: float, burst: float, what: str, clock=time.monotonic):
        self.rate, self.burst, self.what, self.clock = count / period_s, max(burst, 1.0), what, clock
        self.count, self.period = count, self.PERIODS.get(period_s, f"{period_s:g} s")
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def take(self, tenant: Tenant) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            bucket = self._buckets.get(tenant.bucket)
            if bucket is None:
                if len(self._buckets) >= self.MAX_BUCKETS:
                    self._buckets = {k: b for k, b in self._buckets.items() if not b.full()}
                bucket = self._buckets[tenant.bucket] = TokenBucket(self.rate, self.burst, self.clock)
            wait_s = bucket.take()
        if wait_s > 0:
            raise RateLimited(f"at most {self.count:g} {self.what} per {self.period} {tenant.describe()} "
                              f"(bursts of {self.burst:g}); retry in {wait_s:.1f} s", retry_after_s=math.ceil(wait_s))
