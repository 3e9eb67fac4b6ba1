"""Admission in real-time units through the gateway on a real tritonserver (tiny model, one stack for the module).

The server's capacity is forced low (`realtime_capacity` 1.5 audio seconds per second at margin 1.2: one stream
kept ahead at a time), since this machine's own speed varies: three streams sent at once (HTTP and WebSocket)
are one that starts, and others that wait in line with a visible place (`X-Queue-Position` /
`X-Expected-Start-S`, a {"type": "queued"} message) or are refused with 503 + Retry-After. The server's own
listeners (pipeline/capacity.py) record no starved stream. Which of "wait" and "refuse" a stream gets depends
on the measured speed; the test accepts both and asserts only what admission promises.
"""
from __future__ import annotations

import asyncio
import json
import urllib.request
from dataclasses import dataclass

import aiohttp
import pytest

from cosyvoice_triton.prometheus_text import metric_sum

from polling import wait_until
from web.stack import triton_server, wait_ready

MARGIN, FORCED_CAPACITY = 1.2, 1.5  # one real-time slot
MAX_WAIT_S = 3.0
TEXT = "Good morning to you."
TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass
class Stack:
    triton: object
    url: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    from cosyvoice_triton.gateway.config import GatewayConfig, RoutingConfig
    from cosyvoice_triton.gateway.testing import GatewayThread

    root = tmp_path_factory.mktemp("realtime")
    with triton_server(root, tiny_model_dir, workers=4, max_queue_wait_s=MAX_WAIT_S, realtime_margin=MARGIN,
                       realtime_capacity=FORCED_CAPACITY) as (server, model_dir, voice_store):
        config = GatewayConfig(triton=(server.target,), voice_store=voice_store, model_dir=model_dir,
                               home=root / "gateway", shutdown_timeout_s=5.0,
                               routing=RoutingConfig(max_queue_wait_s=MAX_WAIT_S, metrics_interval_s=0.5))
        with GatewayThread(config) as thread:
            wait_ready(thread.url)
            wait_until(lambda: readyz(thread.url).get("capacity"), 30)  # scraped: the gateway knows the slots
            yield Stack(server, thread.url)


def readyz(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/readyz", timeout=10) as response:
        return json.loads(response.read())


def text_of(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@dataclass
class Outcome:
    kind: str  # ok | refused | error
    position: int | None = None  # the place in line the client was shown (None: none shown)
    retry_after: float | None = None
    detail: str = ""


async def http_stream(session, url: str, seed: int) -> Outcome:
    body = {"text": TEXT, "seed": seed, "stream": True, "format": "pcm_f32"}
    async with session.post(f"{url}/v1/tts", json=body) as response:
        position = response.headers.get("X-Queue-Position")
        position = None if position is None else int(position)
        if response.status != 200:
            error = (await response.json())["error"]
            retry = response.headers.get("Retry-After")
            kind = "refused" if response.status == 503 and error["code"] == "overloaded" else "error"
            return Outcome(kind, position, float(retry) if retry else None, f"{response.status} {error}")
        assert float(response.headers["X-Expected-Start-S"]) >= 0
        await response.read()
        return Outcome("ok", position)


async def ws_stream(session, url: str, seed: int) -> Outcome:
    position = None
    async with session.ws_connect(f"{url}/v1/tts/ws") as ws:
        await ws.send_json({"type": "start", "text": TEXT, "seed": seed, "format": "pcm_f32"})
        await ws.send_json({"type": "end"})
        async for message in ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            if data["type"] == "queued":
                assert data["index"] == 0 and data["expected_start_s"] >= 0, data
                position = data["position"]
            elif data["type"] == "error":
                kind = "refused" if data["code"] == "overloaded" else "error"
                return Outcome(kind, position, data.get("retry_after"), str(data))
            elif data["type"] == "end":
                return Outcome("ok", 0 if position is None else position)
    return Outcome("error", position, detail=f"closed without an end message ({ws.close_code})")


def test_streams_beyond_real_time_capacity_wait_in_line_or_are_refused_and_none_starves(stack):
    view = readyz(stack.url)["capacity"][stack.triton.target.name]
    assert view["audio_seconds_per_second"] == FORCED_CAPACITY and view["realtime_slots"] == 1, view
    metrics_url = stack.triton.metrics_url
    starved_before = metric_sum(text_of(metrics_url), "cosyvoice_starved_streams_total", "cosyvoice2")

    async def three_at_once():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return await asyncio.gather(http_stream(session, stack.url, 1), ws_stream(session, stack.url, 2),
                                        http_stream(session, stack.url, 3))

    outcomes = asyncio.new_event_loop().run_until_complete(three_at_once())
    assert all(o.kind in ("ok", "refused") for o in outcomes), outcomes
    assert all(o.retry_after is not None and o.retry_after >= 1 for o in outcomes if o.kind == "refused"), outcomes
    started_at_once = [o for o in outcomes if o.kind == "ok" and not o.position]
    assert len(started_at_once) == 1, outcomes  # one slot: one stream starts, the others are told to wait or refused
    others = [o for o in outcomes if o not in started_at_once]
    assert all(o.kind == "refused" or o.position >= 1 for o in others), outcomes

    text = text_of(metrics_url)
    assert metric_sum(text, "cosyvoice_starved_streams_total", "cosyvoice2") == starved_before
    assert metric_sum(text, "cosyvoice_queue_wait_seconds_count", "cosyvoice2") >= 1


def test_capacity_metrics_are_exported_by_the_server_and_the_gateway(stack):
    text = text_of(stack.triton.metrics_url)
    assert metric_sum(text, "cosyvoice_capacity_audio_seconds_per_second", "cosyvoice2") == FORCED_CAPACITY
    assert metric_sum(text, "cosyvoice_realtime_slots", "cosyvoice2") == 1
    for name in ("cosyvoice_capacity_measured", "cosyvoice_starved_streams_total", "cosyvoice_stall_seconds_total",
                 "cosyvoice_queue_wait_seconds_bucket", "cosyvoice_queued_streams"):
        assert name in text, name
    gateway = text_of(f"{stack.url}/metrics")
    for name in ("cosyvoice_gateway_server_capacity_audio_seconds_per_second",
                 "cosyvoice_gateway_server_realtime_slots"):
        assert f"{name}{{server=" in gateway, name
