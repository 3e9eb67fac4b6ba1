"""The gateway's access log (gateway/access_log.py): one line per request with method, route, status,
first-chunk ms and audio seconds, nothing from headers, query or body. Here on a small aiohttp app with
the gateway's middlewares; on the real service: test_openai_api.py::test_every_request_gets_one_access_line
(first audible audio there too)."""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from cosyvoice_triton.gateway import access_log
from cosyvoice_triton.gateway.app import report_middleware
from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.gateway.errors import error_middleware


async def speak(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    access_log.first_chunk(request, 0.25)
    await response.write(b"\0" * 480)
    access_log.audio_sent(request, 0.5)
    access_log.first_chunk(request, 9.0)  # only the first one counts
    access_log.first_audible(request, 0.3)
    access_log.first_audible(request, 9.0)
    await response.write(b"\0" * 480)
    access_log.audio_sent(request, 0.75)
    await response.write_eof()
    return response


async def refuse(request: web.Request) -> web.Response:
    raise InvalidInput("speed", "must be a number from 0.25 to 4.0")


def lines_of(requests) -> list[str]:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(access_log.ACCESS_LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    async def run():
        app = web.Application(middlewares=[report_middleware(), error_middleware])
        app.router.add_post("/v1/speak", speak)
        app.router.add_get("/v1/voices/{voice_id}", refuse)
        async with TestClient(TestServer(app)) as client:
            for method, path, headers in requests:
                async with client.request(method, path, headers=headers) as response:
                    await response.read()

    try:
        asyncio.run(run())
    finally:
        logger.removeHandler(handler)
    return lines


def test_one_line_per_request_with_first_chunk_and_audio():
    lines = lines_of([("POST", "/v1/speak?api_key=sk-secret", {"Authorization": "Bearer sk-secret"}),
                      ("GET", "/v1/voices/alice", {}), ("GET", "/nowhere", {})])
    assert len(lines) == 3
    speak_line, refused, unmatched = lines
    assert speak_line.startswith("access POST /v1/speak 200 first_chunk_ms=250 first_audible_ms=300 audio_s=1.25 "
                                 "total_ms=")
    assert refused.startswith("access GET /v1/voices/{voice_id} 400 first_chunk_ms=- first_audible_ms=- audio_s=- "
                              "total_ms=")
    assert unmatched.startswith("access GET unmatched 404 ")
    assert not any("secret" in line or "alice" in line for line in lines)


def test_the_gateway_logs_by_default_and_can_be_told_not_to():
    import argparse

    from cosyvoice_triton.gateway.config import add_gateway_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    assert config_from_args(parser.parse_args([])).access_log is True
    assert config_from_args(parser.parse_args(["--no-access-log"])).access_log is False
    access_log.enable_access_log()
    access_log.enable_access_log()  # once per process
    logger = logging.getLogger(access_log.ACCESS_LOGGER)
    assert sum(getattr(h, "_cosyvoice_access", False) for h in logger.handlers) == 1
    assert logger.isEnabledFor(logging.INFO) and not logger.propagate
