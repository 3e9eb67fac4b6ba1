"""API keys and per-key stream limits.

With keys configured, every route except `/`, `/static/*`, `/healthz`, `/readyz` and `/metrics` needs
one: `Authorization: Bearer KEY` (what OpenAI clients send), `X-API-Key: KEY`, or, for WebSockets from
a browser (which cannot set headers), `?api_key=KEY`. Streams are limited per key; without keys, per
client address.
"""
from __future__ import annotations

import hmac
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from .errors import TooManyStreams, Unauthorized
from .request_keys import API_KEY

PUBLIC_PATHS = frozenset({"/", "/healthz", "/readyz", "/metrics", "/favicon.ico"})


def presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("X-API-Key") or request.query.get("api_key")


def auth_middleware(keys: frozenset[str]):
    encoded = [k.encode() for k in keys]

    def valid(key: str | None) -> bool:
        if key is None:
            return False
        given = key.encode()
        return any(hmac.compare_digest(given, k) for k in encoded)  # no early exit on a near match

    @web.middleware
    async def middleware(request: web.Request, handler):
        if keys and request.path not in PUBLIC_PATHS and not request.path.startswith("/static/"):
            key = presented_key(request)
            if not valid(key):
                raise Unauthorized() if key is None else Unauthorized("the API key is not valid")
            request[API_KEY] = key
        return await handler(request)

    return middleware


def limit_key(request: web.Request) -> str:
    key = request.get(API_KEY)
    return f"key:{key}" if key else f"addr:{request.remote}"


class StreamLimiter:
    """At most `limit` concurrent streams per key (429 beyond)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def slot(self, key: str) -> Iterator[None]:
        if self._counts[key] >= self.limit:
            raise TooManyStreams(f"at most {self.limit} concurrent streams per API key; wait for one to end")
        self._counts[key] += 1
        try:
            yield
        finally:
            self._counts[key] -= 1
            if self._counts[key] <= 0:
                del self._counts[key]

    def active(self, key: str) -> int:
        return self._counts.get(key, 0)
