"""A client that leaves a streamed answer is counted once, as "cancelled", and the access log and the requests
counter show that one status, whenever it leaves: before the first byte, mid-stream, or during the last chunk,
and whether the gateway notices it as its handler's cancellation or as a write that fails on the closing
connection (run here without handler cancellation, so only the write can tell).

The gateway's own reporting middleware, error middleware and send loop (audio_response.send_audio) run on a
real aiohttp server over loopback; the client is a raw socket, so the test decides when it leaves. What stands
in for Triton is a chunk source that waits until the server has seen the client go; with a real server:
test_gateway.py::test_a_client_that_leaves_mid_stream_frees_its_triton_stream.
"""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import web

from cosyvoice_triton.audio_out import audio_format
from cosyvoice_triton.gateway import access_log, audio_response
from cosyvoice_triton.gateway.app import report_middleware
from cosyvoice_triton.gateway.config import GatewayConfig
from cosyvoice_triton.gateway.errors import error_middleware
from cosyvoice_triton.gateway.fields import TTS_FIELDS
from cosyvoice_triton.gateway.metrics import GatewayMetrics
from cosyvoice_triton.gateway.state import CONFIG, METRICS
from cosyvoice_triton.targets import TritonTarget

ROUTE = "/v1/speak"
CHUNKS = 3
CURRENT = web.AppKey("current", dict)  # the test's view of the one request being served


def gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def chunk_source(app: web.Application, leave_at: str):
    """Three 0.1 s chunks; at `leave_at` it tells the client to leave and waits until the server has seen it."""
    state = app[CURRENT]

    async def client_leaves() -> None:
        state["leave"].set()
        while not gone(state["request"]):  # the loop must first read the client's FIN (or RST)
            await asyncio.sleep(0.005)

    if leave_at == "before_first_byte":
        await client_leaves()
    for index in range(CHUNKS):
        yield np.full(2400, 0.1, np.float32)
        if leave_at == "mid_stream" and index == 0:
            await client_leaves()
    if leave_at == "last_chunk":
        await client_leaves()


def app_with(leave_at: str, body: str) -> web.Application:
    app = web.Application(middlewares=[report_middleware(), error_middleware])
    app[CONFIG] = GatewayConfig(triton=(TritonTarget.parse("grpc://127.0.0.1:1"),))  # never called
    app[METRICS] = GatewayMetrics(SimpleNamespace(servers=[]))
    app[CURRENT] = {"leave": asyncio.Event()}

    async def speak(request: web.Request) -> web.StreamResponse:
        app[CURRENT]["request"] = request
        answer = audio_response.AudioEvents(input_tokens=2) if body == "events" else audio_response.AUDIO_BYTES
        return await audio_response.send_audio(request, SimpleNamespace(seed=1), 1.0, TTS_FIELDS,
                                               audio_format("pcm"), True, "tts", answer)

    app.router.add_post(ROUTE, speak)
    return app


async def leave(app: web.Application, port: int, how: str) -> None:
    """POST a request, read what comes until told to leave, then close the socket (FIN) or cut it (RST)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {ROUTE} HTTP/1.1\r\nHost: test\r\nContent-Length: 2\r\n\r\n{{}}".encode())
    await writer.drain()
    await asyncio.wait_for(app[CURRENT]["leave"].wait(), 30)
    if how == "reset":
        writer.transport.abort()
    else:
        writer.close()


async def serve_once(leave_at: str, body: str, how: str, cancellation: bool, monkeypatch) -> tuple[list[str], dict]:
    """(access lines, counter samples {status: value} of the route) once the server has reported the request."""
    app = app_with(leave_at, body)
    monkeypatch.setattr(audio_response, "stream_audio", lambda app_, *args: chunk_source(app_, leave_at))
    runner = web.AppRunner(app, handler_cancellation=cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        await leave(app, site._server.sockets[0].getsockname()[1], how)
        for _ in range(3000):  # until the request is reported (a bound, not a timing check)
            if LINES:
                break
            await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
    counted = {sample.labels["status"]: sample.value for metric in app[METRICS].requests.collect()
               for sample in metric.samples if sample.name.endswith("_total") and sample.labels["route"] == ROUTE}
    errors = {sample.labels["kind"]: sample.value for metric in app[METRICS].errors.collect()
              for sample in metric.samples if sample.name.endswith("_total")}
    return list(LINES), {"requests": counted, "errors": errors}


LINES: list[str] = []


@pytest.fixture(autouse=True)
def access_lines():
    handler = logging.Handler()
    handler.emit = lambda record: LINES.append(record.getMessage())
    logger = logging.getLogger(access_log.ACCESS_LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    LINES.clear()
    yield
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("cancellation", [False, True], ids=["seen_by_a_write", "handler_cancelled"])
@pytest.mark.parametrize("leave_at,body,how", [
    ("before_first_byte", "bytes", "close"),
    ("mid_stream", "bytes", "close"),
    ("mid_stream", "bytes", "reset"),
    ("mid_stream", "events", "close"),
    ("last_chunk", "bytes", "close"),
    ("last_chunk", "events", "reset"),
])
def test_a_client_that_leaves_is_one_cancelled_request_in_the_log_and_the_counter(leave_at, body, how, cancellation,
                                                                                monkeypatch):
    lines, counters = asyncio.run(serve_once(leave_at, body, how, cancellation, monkeypatch))
    assert len(lines) == 1 and lines[0].startswith(f"access POST {ROUTE} cancelled "), lines
    assert counters == {"requests": {"cancelled": 1.0}, "errors": {}}, (lines, counters)
