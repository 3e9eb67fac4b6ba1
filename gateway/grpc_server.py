"""What the gateway's two gRPC services share (official_grpc.py: `cosyvoice.CosyVoice`; triton_facade.py: Triton's
own protocol): the gRPC status of a gateway error's HTTP status, a call's metadata read as headers, and a server's
life in the app's cleanup_ctx."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from .drain import CUT_AFTER_DRAIN_S
from .state import CONFIG

MESSAGE_OVERHEAD_BYTES = 64 * 1024  # the texts and settings next to the prompt audio in one request
GRPC_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
               403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
               408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
               429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
               504: grpc.StatusCode.DEADLINE_EXCEEDED}


def grpc_status(http_status: int) -> grpc.StatusCode:
    """The gRPC status of a gateway answer's HTTP status (INTERNAL for any other)."""
    return GRPC_STATUS.get(http_status, grpc.StatusCode.INTERNAL)


def metadata_headers(metadata) -> CIMultiDictProxy:
    """A call's metadata as HTTP-like headers (-bin values, which are bytes, are no headers)."""
    return CIMultiDictProxy(CIMultiDict((key, value) for key, value in metadata or () if isinstance(value, str)))


@asynccontextmanager
async def running_server(app: web.Application, port: int, add_servicer: Callable[[grpc.aio.Server], None],
                         options: list[tuple[str, int]], name: str, what: str) -> AsyncIterator[int]:
    """A grpc.aio server on the gateway's host and `port` (0: a free one), printed at start as
    "  NAME HOST:PORT (WHAT)"; yields the port. Calls still running at the end get CUT_AFTER_DRAIN_S (the
    drain waited for them)."""
    host = app[CONFIG].host
    host = f"[{host}]" if ":" in host else host
    server = grpc.aio.server(options=options)
    add_servicer(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"  {name} {host}:{bound} ({what})", flush=True)
    try:
        yield bound
    finally:
        await server.stop(CUT_AFTER_DRAIN_S)
