"""The gateway's limits on a real gateway: request and registration rates per key (429 + Retry-After),
the keyless stream limit and its message, WebSocket idle and session timeouts (the slot is freed), and
/readyz reporting the voice store. None of these reach Triton, so the gateway points at a port where no
server listens (it is not ready, and needs not be)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import pytest
import requests

from cosyvoice_triton.client import AsyncGatewayTTS, GatewayTTS, TTSError
from cosyvoice_triton.gateway.config import GatewayConfig, Limits
from cosyvoice_triton.gateway.testing import GatewayThread
from cosyvoice_triton.server.process import free_port
from cosyvoice_triton.targets import TritonTarget
from redis_harness import redis_binary_or_skip, start_redis

pytestmark = pytest.mark.timeout(120)

KEY_A, KEY_B = "limit-key-a", "limit-key-b"


def config(tmp_path, keys=(), **limits) -> GatewayConfig:
    return GatewayConfig(triton=(TritonTarget.parse(f"grpc://127.0.0.1:{free_port()}"),),
                         voice_store=str(tmp_path / "voices.sqlite"), home=tmp_path, default_voice=False,
                         api_keys=frozenset(keys), limits=Limits(**limits))


def get(gateway, path: str, key: str | None = None) -> requests.Response:
    headers = {"X-API-Key": key} if key else {}
    return requests.get(gateway.url + path, headers=headers, timeout=30)


def test_request_rate_per_key_answers_429_with_retry_after(tmp_path):
    with GatewayThread(config(tmp_path, (KEY_A, KEY_B), requests_per_second=0.5, request_burst=3)) as gateway:
        statuses = [get(gateway, "/v1/voices", KEY_A).status_code for _ in range(6)]
        assert statuses[:3] == [200, 200, 200] and set(statuses[3:]) == {429}, statuses
        refused = get(gateway, "/v1/voices", KEY_A)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "rate_limited" and "per API key" in error["message"], error
        assert_sdk_refusals_carry_retry_after(gateway.url, KEY_A)
        assert get(gateway, "/v1/voices", KEY_B).status_code == 200  # another key has its own bucket
        assert get(gateway, "/healthz").status_code == 200  # public routes are not counted


def assert_sdk_refusals_carry_retry_after(url: str, key: str) -> None:
    """The SDKs' TTSError carries the 429's Retry-After (blocking and asyncio clients)."""
    with pytest.raises(TTSError) as blocking:
        GatewayTTS(url, api_key=key).list_voices()

    async def list_voices():
        async with AsyncGatewayTTS(url, api_key=key) as tts:
            await tts.list_voices()

    with pytest.raises(TTSError) as awaited:
        asyncio.run(list_voices())
    for refused in (blocking.value, awaited.value):
        assert refused.status == 429 and refused.code == "rate_limited" and refused.retry_after_s >= 1, refused


def test_keyless_use_shares_one_request_bucket_and_says_so(tmp_path):
    with GatewayThread(config(tmp_path, requests_per_second=0.5, request_burst=2)) as gateway:
        statuses = [get(gateway, "/v1/voices").status_code for _ in range(4)]
        assert statuses[:2] == [200, 200] and statuses[2:] == [429, 429], statuses
        assert "for keyless use" in get(gateway, "/v1/voices").json()["error"]["message"]


def test_registration_rate_per_key(tmp_path):
    with GatewayThread(config(tmp_path, (KEY_A, KEY_B), registrations_per_minute=1, registration_burst=2)) as gw:
        def register(key):
            return requests.post(gw.url + "/v1/voices", headers={"X-API-Key": key}, timeout=30,
                                 files={"audio": ("p.wav", b"not audio", "audio/wav")}, data={"text": "x"})

        assert [register(KEY_A).status_code for _ in range(2)] == [400, 400]  # counted, then refused as audio
        refused = register(KEY_A)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
        assert "registrations per minute" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        assert register(KEY_B).status_code == 400


def test_keyless_streams_are_limited_all_together_with_an_honest_message(tmp_path):
    async def scenario(gateway):
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(gateway.url + "/v1/tts/ws") as first:
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(gateway.url + "/v1/tts/ws")
                assert refused.value.status == 429
                async with http.get(gateway.url + "/v1/tts/ws") as plain:  # the same refusal, with its body
                    body = await plain.json()
                assert plain.status == 429 and plain.headers["Retry-After"] == "1"
                assert "for keyless use (all callers together)" in body["error"]["message"]
                assert "per API key" not in body["error"]["message"]
                async with AsyncGatewayTTS(gateway.url) as tts:  # the SDKs: refused at the upgrade, with the hint
                    with pytest.raises(TTSError) as awaited:
                        await tts.stream_ws("Hi.")
                with pytest.raises(TTSError) as blocking:
                    GatewayTTS(gateway.url).stream_ws("Hi.")
                for sdk_refused in (awaited.value, blocking.value):
                    assert (sdk_refused.status, sdk_refused.retry_after_s) == (429, 1.0), sdk_refused
                await first.close()

    with GatewayThread(config(tmp_path, max_keyless_streams=1, max_streams_per_key=5)) as gateway:
        asyncio.run(scenario(gateway))


def test_an_idle_websocket_is_closed_with_a_reason_and_frees_its_slot(tmp_path):
    async def scenario(gateway):
        async with aiohttp.ClientSession() as http:
            headers = {"X-API-Key": KEY_A}
            async with http.ws_connect(gateway.url + "/v1/tts/ws", headers=headers) as ws:
                message = await ws.receive_json(timeout=30)  # sent nothing at all
                assert message["type"] == "error" and message["code"] == "idle_timeout", message
                assert message["status"] == 408
                closing = await ws.receive(timeout=30)
                assert closing.type == aiohttp.WSMsgType.CLOSE and closing.extra == "idle_timeout"
            async with http.ws_connect(gateway.url + "/v1/tts/ws", headers=headers) as again:  # the slot is free
                assert (await again.receive_json(timeout=30))["code"] == "idle_timeout"

    with GatewayThread(config(tmp_path, (KEY_A,), max_streams_per_key=1, ws_idle_timeout_s=0.5)) as gateway:
        asyncio.run(scenario(gateway))


def test_a_websocket_session_has_a_time_limit(tmp_path):
    async def scenario(gateway):
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(gateway.url + "/v1/tts/ws") as ws:
                message = await ws.receive_json(timeout=30)  # long before the idle limit
                assert message["type"] == "error" and message["code"] == "session_timeout", message
                assert (await ws.receive(timeout=30)).extra == "session_timeout"

    limits = dict(max_streams_per_key=1, ws_idle_timeout_s=60.0, ws_session_timeout_s=1.0)
    with GatewayThread(config(tmp_path, **limits)) as gateway:
        asyncio.run(scenario(gateway))


def test_readyz_reports_a_voice_store_that_stops_answering(tmp_path):
    server = start_redis(redis_binary_or_skip(), tmp_path)
    try:
        with GatewayThread(replace(config(tmp_path), voice_store=server.url)) as gateway:
            status, body = gateway.get_json("/readyz")
            assert status == 503 and body["voice_store"] == "ok"  # not ready: no Triton server, store fine
            server.stop()
            status, body = gateway.get_json("/readyz")
            assert status == 503 and body["ready"] is False and body["voice_store"] == "unavailable"
            assert "Redis" in body["voice_store_error"] or "redis" in body["voice_store_error"].lower(), body
            listing = get(gateway, "/v1/voices")
            assert listing.status_code == 503 and listing.json()["error"]["code"] == "unavailable"
    finally:
        server.stop()


def test_keys_come_from_files_and_the_environment_and_argv_keys_warn(tmp_path, monkeypatch, caplog):
    import argparse

    from cosyvoice_triton.gateway.config import add_gateway_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    keys, admin = tmp_path / "keys.txt", tmp_path / "admin.txt"
    keys.write_text("# one key a line\nkey-from-file\n\n  other-key  \n")
    admin.write_text("admin-from-file\n")
    monkeypatch.setenv("COSYVOICE_API_KEYS", "env-key, second-env-key")
    monkeypatch.setenv("COSYVOICE_ADMIN_KEYS", "env-admin")
    args = parser.parse_args(["--api-key-file", str(keys), "--admin-key-file", str(admin)])
    with caplog.at_level("WARNING"):
        config = config_from_args(args)
    assert config.api_keys == {"key-from-file", "other-key", "env-key", "second-env-key"}
    assert config.admin_keys == {"admin-from-file", "env-admin"}
    assert "ps" not in caplog.text
    with caplog.at_level("WARNING"):
        config = config_from_args(parser.parse_args(["--api-key", "visible-key"]))
    assert "visible-key" in config.api_keys and "`ps` shows them" in caplog.text
    assert config.limits.request_burst == 2 * int(config.limits.requests_per_second)
