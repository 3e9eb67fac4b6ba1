"""Tenants: voices belong to the owner (API key) that registered them; shared voices are everyone's.

The store keeps an owner tag per voice (SQLite and Redis, old data migrated as shared); the gateway
scopes listing, use and deletion by key, over HTTP, WebSocket and the OpenAI route (tests further down).
"""
from __future__ import annotations

import json
import sqlite3

import pytest
import redis

from cosyvoice_triton.voices.store import content_key, generated_voice_id, register_once, visible_to
from cosyvoice_triton.voices.stores import open_voice_store
from cosyvoice_triton.voices.redis_store import CONTENT_KEY, IDS_KEY, voice_key
from redis_harness import redis_server  # noqa: F401  (a fixture)
from test_voice_store import make_features

ALICE, BOB = "key_alice", "key_bob"

OLD_SQLITE_SCHEMA = """
CREATE TABLE voices (
    voice_id TEXT PRIMARY KEY, content_key TEXT NOT NULL UNIQUE, revision TEXT NOT NULL, text TEXT NOT NULL,
    audio_sha256 TEXT NOT NULL, tokens INTEGER NOT NULL, created_at REAL NOT NULL, name TEXT, blob BLOB NOT NULL
)"""


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'voices.sqlite'}"
    server = request.getfixturevalue("redis_server")
    server.flush()
    return server.url


def test_each_owner_gets_its_own_voice_for_one_recording(store_url):
    store = open_voice_store(store_url)
    features = make_features()
    shared = store.register(features)
    alice = store.register(features, owner=ALICE)
    bob = register_once(store, features.audio_sha256, features.text, lambda: features, owner=BOB)
    assert len({shared.voice_id, alice.voice_id, bob.voice_id}) == 3
    assert (shared.owner, alice.owner, bob.owner) == (None, ALICE, BOB)
    assert alice.voice_id == generated_voice_id(features.audio_sha256, features.text, ALICE)
    assert store.register(features, owner=ALICE) == alice  # idempotent per owner
    assert store.find(features.audio_sha256, features.text, BOB) == bob
    assert store.info(alice.voice_id).owner == ALICE
    assert {v.voice_id for v in store.list() if visible_to(v, BOB)} == {shared.voice_id, bob.voice_id}
    assert {v.voice_id for v in store.list() if visible_to(v, None)} == {shared.voice_id, alice.voice_id,
                                                                        bob.voice_id}
    store.close()


def test_an_old_sqlite_file_gains_owners_and_its_voices_are_shared(tmp_path):
    path = tmp_path / "old.sqlite"
    features = make_features()
    with sqlite3.connect(path) as db:  # a file as the store wrote it before owners existed
        db.execute(OLD_SQLITE_SCHEMA)
        new = open_voice_store(f"sqlite://{tmp_path / 'blob.sqlite'}")  # to borrow a real blob and revision
        info = new.register(features, voice_id="old")
        blob, revision = sqlite3.connect(tmp_path / "blob.sqlite").execute(
            "SELECT blob, revision FROM voices").fetchone()
        new.close()
        db.execute("INSERT INTO voices VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   ("old", content_key(features.audio_sha256, features.text), revision, info.text,
                    info.audio_sha256, info.tokens, info.created_at, None, blob))
    store = open_voice_store(f"sqlite://{path}")
    assert store.info("old").owner is None and store.info("old").shared
    assert store.find(features.audio_sha256, features.text) == store.info("old")  # old content key still found
    assert store.get("old").text == features.text
    mine = store.register(features, owner=ALICE)
    assert mine.voice_id != "old" and store.info(mine.voice_id).owner == ALICE
    store.close()
    assert open_voice_store(f"sqlite://{path}").info(mine.voice_id).owner == ALICE  # reopened: migrated once


def test_old_redis_entries_read_as_shared(redis_server):  # noqa: F811
    redis_server.flush()
    store = open_voice_store(redis_server.url)
    features = make_features()
    info = store.register(features, voice_id="old")
    with redis.Redis.from_url(redis_server.url) as client:  # rewrite its info as written before owners
        raw = json.loads(client.hget(voice_key("old"), "info"))
        del raw["owner"]
        client.hset(voice_key("old"), "info", json.dumps(raw))
        assert client.sismember(IDS_KEY, "old") and client.hget(CONTENT_KEY, content_key(
            features.audio_sha256, features.text)) == b"old"
    reopened = open_voice_store(redis_server.url)
    assert reopened.info("old").owner is None
    assert reopened.find(features.audio_sha256, features.text) == info
    assert [v.voice_id for v in reopened.list()] == ["old"]
    store.close()
    reopened.close()


# ---- through the gateway: two keys and an admin, on SQLite and on Redis ---------------------------------
import asyncio  # noqa: E402
import io  # noqa: E402

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402
import requests  # noqa: E402
import soundfile as sf  # noqa: E402

from cosyvoice_triton.random_folder.sample_prompt import speech_like  # noqa: E402

KEY_A, KEY_B, ADMIN = "tenant-a-key", "tenant-b-key", "admin-key"
RATE = 16000


def wav(seed: int, seconds: float = 2.0) -> bytes:
    out = io.BytesIO()
    sf.write(out, speech_like(seconds, RATE, seed=seed), RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def stack(request, tiny_model_dir, tmp_path_factory):
    """tritonserver and a gateway with keys A, B and an admin key, sharing one voice store."""
    from cosyvoice_triton.gateway.config import GatewayConfig, RoutingConfig
    from cosyvoice_triton.gateway.testing import GatewayThread
    from cosyvoice_triton.server.launcher import ServeOptions, prepare
    from triton_harness import tritonserver_or_skip

    binary = tritonserver_or_skip()
    run_dir = tmp_path_factory.mktemp(f"tenants-{request.param}")
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        server.flush()
        store = server.url
    else:
        store = str(run_dir / "voices.sqlite")
    options = ServeOptions(model_dir=tiny_model_dir, run_dir=run_dir, address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, voice_store=store, max_token_text_ratio=3.0,
                           torch_threads=1, workers=4)
    triton = prepare(options, binary=binary, die_with_parent=True)
    triton.start()
    config = GatewayConfig(triton=(triton.target,), voice_store=store, model_dir=tiny_model_dir,
                           home=tmp_path_factory.mktemp("home"), api_keys=frozenset({KEY_A, KEY_B}),
                           admin_keys=frozenset({ADMIN}),
                           routing=RoutingConfig(health_interval_s=1.0, metrics_interval_s=1.0))
    try:
        with GatewayThread(config) as gateway:
            gateway.wait_ready()
            yield gateway
    finally:
        triton.stop()


def call(gateway, method: str, path: str, key: str | None, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, gateway.url + path, headers=headers, timeout=120, **kwargs)


def register(gateway, key: str, seed: int, **fields) -> requests.Response:
    return call(gateway, "POST", "/v1/voices", key, files={"audio": ("p.wav", wav(seed), "audio/wav")},
                data={"text": "a short voice prompt", **fields})


def ids(gateway, key: str) -> set[str]:
    response = call(gateway, "GET", "/v1/voices", key)
    assert response.status_code == 200, response.text
    return {v["id"] for v in response.json()["voices"]}


def tts(gateway, key: str, voice: str) -> requests.Response:
    return call(gateway, "POST", "/v1/tts", key, json={"text": "Hello there.", "voice_id": voice, "seed": 3})


async def ws_start(gateway, key: str, voice: str) -> dict:
    """The first answer of a WebSocket session started with `voice`, and, if it started, its end."""
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(gateway.url + f"/v1/tts/ws?api_key={key}") as ws:
            await ws.send_json({"type": "start", "voice_id": voice, "text": "Hi there.", "seed": 2})
            first = await ws.receive_json(timeout=120)
            if first["type"] != "started":
                return first
            await ws.send_json({"type": "end"})
            audio = 0
            while True:
                message = await ws.receive(timeout=120)
                if message.type == aiohttp.WSMsgType.BINARY:
                    audio += len(message.data)
                elif message.type == aiohttp.WSMsgType.TEXT and message.json()["type"] == "end":
                    return {"type": "end", "audio_bytes": audio}
                elif message.type != aiohttp.WSMsgType.TEXT:
                    return {"type": "closed"}


def openai_speech(gateway, key: str, voice: str):
    import openai

    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=120)
    return client.audio.speech.create(model="cosyvoice2", voice=voice, input="Hello there.",
                                      response_format="wav")


def test_a_keys_voice_is_invisible_and_unusable_to_another_key(stack):
    import openai

    created = register(stack, KEY_A, seed=11, id="tenant-a-voice")
    assert created.status_code == 201 and created.json()["shared"] is False, created.text
    voice = created.json()["id"]
    assert voice in ids(stack, KEY_A) and "default" in ids(stack, KEY_A)
    assert voice not in ids(stack, KEY_B) and "default" in ids(stack, KEY_B)

    # B: 404 everywhere, with the same body as for a voice that does not exist
    for path in (f"/v1/voices/{voice}", "/v1/voices/no-such-voice"):
        for method in ("GET", "DELETE"):
            response = call(stack, method, path, KEY_B)
            assert response.status_code == 404 and response.json()["error"]["code"] == "not_found", response.text
    refused = tts(stack, KEY_B, voice)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "voice_id"
    assert tts(stack, KEY_B, "no-such-voice").json()["error"]["message"].replace("no-such-voice", voice) == \
        refused.json()["error"]["message"]
    answer = asyncio.run(ws_start(stack, KEY_B, voice))
    assert answer["type"] == "error" and answer["status"] == 404, answer
    with pytest.raises(openai.NotFoundError):
        openai_speech(stack, KEY_B, voice)

    # A: its own voice works on every route, and is still there after B's attempts
    ok = tts(stack, KEY_A, voice)
    assert ok.status_code == 200 and sf.read(io.BytesIO(ok.content))[0].size > 0
    assert asyncio.run(ws_start(stack, KEY_A, voice))["audio_bytes"] > 0
    assert sf.read(io.BytesIO(openai_speech(stack, KEY_A, voice).read()))[0].size > 0
    assert call(stack, "GET", f"/v1/voices/{voice}", KEY_A).status_code == 200
    assert call(stack, "DELETE", f"/v1/voices/{voice}", KEY_A).json() == {"id": voice, "deleted": True}
    assert voice not in ids(stack, KEY_A)


def test_one_recording_registered_by_two_keys_is_two_voices(stack):
    a, b = register(stack, KEY_A, seed=12), register(stack, KEY_B, seed=12)
    assert a.status_code == b.status_code == 201, (a.text, b.text)
    assert a.json()["id"] != b.json()["id"]
    assert register(stack, KEY_A, seed=12).status_code == 200  # idempotent per key
    assert call(stack, "DELETE", f"/v1/voices/{a.json()['id']}", KEY_A).status_code == 200
    assert b.json()["id"] in ids(stack, KEY_B)  # B's copy stays


def test_shared_voices_are_read_only_except_to_an_admin_key(stack):
    refused = register(stack, KEY_A, seed=13, shared="true")
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "shared"
    shared = register(stack, ADMIN, seed=13, shared="true", id="team-voice")
    assert shared.status_code == 201 and shared.json()["shared"] is True, shared.text
    assert "team-voice" in ids(stack, KEY_A) and "team-voice" in ids(stack, KEY_B)
    assert tts(stack, KEY_B, "team-voice").status_code == 200
    for key in (KEY_A, KEY_B):
        for voice in ("team-voice", "default"):
            response = call(stack, "DELETE", f"/v1/voices/{voice}", key)
            assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden"
    assert call(stack, "DELETE", "/v1/voices/team-voice", ADMIN).status_code == 200
    assert "team-voice" not in ids(stack, KEY_A)
    assert tts(stack, KEY_A, "default").status_code == 200  # default survived every attempt


def test_keys_travel_in_headers_and_only_the_websocket_takes_api_key_in_the_url(stack):
    in_url = requests.get(stack.url + f"/v1/voices?api_key={KEY_A}", timeout=30)
    assert in_url.status_code == 401 and "WebSocket" in in_url.json()["error"]["message"]
    assert call(stack, "GET", "/v1/voices", "not-a-key").status_code == 401
    assert requests.get(stack.url + "/v1/voices", headers={"X-API-Key": KEY_B}, timeout=30).status_code == 200
    assert asyncio.run(ws_start(stack, KEY_A, "default"))["type"] == "end"
