"""Tenants: voices belong to the owner (API key) that registered them, each owner with its own ids; shared voices
are everyone's.

The store keeps voices by (owner, id) (SQLite and Redis, old data migrated: voices without owners shared, owned
voices of one-space ids kept under their ids); the gateway scopes registration, listing, use and deletion by key,
over HTTP, WebSocket, the OpenAI and official-compatible routes and the Triton gRPC facade, and Triton resolves an
id (SSML's <voice name> too) in the owner's space (tests further down).
"""
from __future__ import annotations

import json
import sqlite3

import pytest
import redis

from cosyvoice_triton.errors import InvalidInput, NotFound
from cosyvoice_triton.voices.store import content_key, generated_voice_id, register_once
from cosyvoice_triton.voices.stores import open_voice_store
from cosyvoice_triton.voices.redis_store import CONTENT_KEY, IDS_KEY, LAYOUT_KEY, voice_key
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
    assert store.info(alice.voice_id, ALICE).owner == ALICE
    assert {v.voice_id for v in store.list(BOB)} == {shared.voice_id, bob.voice_id}
    assert {v.voice_id for v in store.list()} == {shared.voice_id}  # keyless use: the shared voices
    store.close()


def test_each_owner_has_its_own_ids(store_url):
    store = open_voice_store(store_url)
    mine, theirs, public = make_features(seed=1), make_features(seed=2), make_features(seed=3)
    alice = store.register(mine, "myvoice", owner=ALICE)
    bob = store.register(theirs, "myvoice", owner=BOB)  # Alice's id is no business of Bob's: it is free
    assert (alice.voice_id, alice.owner, bob.voice_id, bob.owner) == ("myvoice", ALICE, "myvoice", BOB)
    for owner, features in ((ALICE, mine), (BOB, theirs)):
        assert store.info("myvoice", owner).audio_sha256 == features.audio_sha256
        assert store.get("myvoice", owner).audio_sha256 == features.audio_sha256
        assert [v.audio_sha256 for v in store.list(owner) if v.voice_id == "myvoice"] == [features.audio_sha256]
    with pytest.raises(NotFound):
        store.get("myvoice")  # nor is it keyless use's, which sees the shared voices
    assert store.list() == []

    store.register(public, "team")  # shared: seen by every owner, and its id is not free to any of them
    assert store.get("team", ALICE).audio_sha256 == store.get("team", BOB).audio_sha256 == public.audio_sha256
    with pytest.raises(InvalidInput, match="shared voice"):
        store.register(make_features(seed=9), "team", owner=ALICE)
    with pytest.raises(InvalidInput, match="taken by a different recording"):
        store.register(make_features(seed=4), "myvoice", owner=ALICE)  # its own id of other content

    assert store.delete("myvoice", BOB) and not store.delete("myvoice", BOB)
    with pytest.raises(NotFound):
        store.info("myvoice", BOB)  # Bob's is gone; Alice's is not his to see
    assert store.get("myvoice", ALICE).audio_sha256 == mine.audio_sha256
    assert not store.delete("team", ALICE)  # an owner's delete names its own voice, never the shared one
    assert store.info("team", BOB).shared
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
    assert mine.voice_id != "old" and store.info(mine.voice_id, ALICE).owner == ALICE
    store.close()
    assert open_voice_store(f"sqlite://{path}").info(mine.voice_id, ALICE).owner == ALICE  # reopened: migrated once


def test_owned_voices_of_a_file_with_one_id_space_keep_their_ids(tmp_path):
    """A file of the version whose ids were one space for every owner (keyed by voice id, with owners): its owned
    voices keep their ids, in their owner's space, and the same id is then free to another owner."""
    path, features = tmp_path / "one-space.sqlite", make_features(seed=5)
    new = open_voice_store(f"sqlite://{tmp_path / 'blob.sqlite'}")  # to borrow a real blob and revision
    info = new.register(features, voice_id="k1voice")
    blob, revision = sqlite3.connect(tmp_path / "blob.sqlite").execute("SELECT blob, revision FROM voices").fetchone()
    new.close()
    with sqlite3.connect(path) as db:
        db.execute(OLD_SQLITE_SCHEMA.replace("blob BLOB NOT NULL", "blob BLOB NOT NULL, owner TEXT"))
        db.execute("INSERT INTO voices VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   ("k1voice", content_key(features.audio_sha256, features.text, ALICE), revision, info.text,
                    info.audio_sha256, info.tokens, info.created_at, None, blob, ALICE))
    store = open_voice_store(f"sqlite://{path}")
    assert store.info("k1voice", ALICE).owner == ALICE and store.get("k1voice", ALICE).text == features.text
    assert store.register(features, owner=ALICE).voice_id == "k1voice"  # its content key still found
    with pytest.raises(NotFound):
        store.info("k1voice", BOB)
    assert store.register(make_features(seed=6), "k1voice", owner=BOB).owner == BOB
    assert [v.owner for v in (store.info("k1voice", ALICE), store.info("k1voice", BOB))] == [ALICE, BOB]
    store.close()


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


def test_old_redis_owned_voices_move_to_their_owners_space(redis_server):  # noqa: F811
    """Owned voices written when ids were one space for every owner (kept under their id) move, when a store
    opens, under their owner's space with their ids, once; the id is then free to another owner."""
    redis_server.flush()
    features = make_features(seed=7)
    store = open_voice_store(redis_server.url)
    store.register(features, "k1voice", owner=ALICE)
    with redis.Redis.from_url(redis_server.url) as client:  # as that version kept it
        client.rename(voice_key(f"{ALICE}/k1voice"), voice_key("k1voice"))
        client.srem(IDS_KEY, f"{ALICE}/k1voice")
        client.sadd(IDS_KEY, "k1voice")
        client.hset(CONTENT_KEY, content_key(features.audio_sha256, features.text, ALICE), "k1voice")
        client.delete(LAYOUT_KEY)
    store.close()
    first, second = open_voice_store(redis_server.url), open_voice_store(redis_server.url)  # moved once
    assert first.info("k1voice", ALICE).owner == ALICE and second.get("k1voice", ALICE).text == features.text
    assert first.find(features.audio_sha256, features.text, ALICE).voice_id == "k1voice"
    with pytest.raises(NotFound):
        first.info("k1voice")
    assert second.register(make_features(seed=8), "k1voice", owner=BOB).owner == BOB
    with redis.Redis.from_url(redis_server.url) as client:
        assert client.smembers(IDS_KEY) == {f"{ALICE}/k1voice".encode(), f"{BOB}/k1voice".encode()}
    first.close()
    second.close()


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
                           admin_keys=frozenset({ADMIN}), official_triton_port=0,
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
                                      response_format="wav", extra_body={"seed": 3})


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


# ---- one id, two keys: each key its own id space ---------------------------------------------------------
SSML = '<speak><voice name="{}">Hello there.</voice></speak>'


def sound(response: requests.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return sf.read(io.BytesIO(response.content), dtype="float32")[0]


def official_sft(gateway, key: str, voice: str) -> requests.Response:
    return call(gateway, "POST", "/inference_sft", key, data={"tts_text": "Hello there.", "spk_id": voice, "seed": "3"})


def kserve(gateway, key: str, voice: str, owner: str | None = None) -> requests.Response:
    inputs = [{"name": "target_text", "shape": [1], "datatype": "BYTES", "data": ["Hello there."]},
              {"name": "reference_audio_id", "shape": [1], "datatype": "BYTES", "data": [voice]},
              {"name": "seed", "shape": [1], "datatype": "UINT64", "data": [3]}]
    if owner is not None:  # a client's own owner input: the gateway puts its caller's in its place
        inputs.append({"name": "owner", "shape": [1], "datatype": "BYTES", "data": [owner]})
    return call(gateway, "POST", "/v2/models/cosyvoice2_offline/infer", key, json={"inputs": inputs})


def facade(gateway, key: str, voice: str, owner: str | None = None) -> np.ndarray:
    """cosyvoice2_offline through the gateway's Triton gRPC port; raises InferenceServerException."""
    import tritonclient.grpc as grpcclient
    from cosyvoice_triton.gateway.triton_facade import OFFICIAL_TRITON_PORT
    from triton_harness import grpc_inputs

    values = {"target_text": np.array(["Hello there."], object), "reference_audio_id": np.array([voice], object),
              "seed": np.array([3], np.uint64)}
    if owner is not None:
        values["owner"] = np.array([owner], object)
    port = gateway.call(lambda app: app[OFFICIAL_TRITON_PORT])
    with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
        result = client.infer("cosyvoice2_offline", grpc_inputs(values), headers={"authorization": f"Bearer {key}"},
                              client_timeout=120)
    return result.as_numpy("waveform")


def test_an_id_another_key_uses_is_free_and_each_key_speaks_its_own_voice(stack):
    """Key A registers "myvoice"; key B registers "myvoice" from another recording: no "taken" answer (that would
    tell B that A's id exists). Each key's "myvoice" is its own recording on every route (HTTP, SSML <voice name>,
    WebSocket, OpenAI, official HTTP, KServe, the Triton gRPC facade), as B's copy of A's recording under another
    id shows; B can neither list, read, delete nor use A's, not even by sending A's owner tag itself."""
    import openai
    from tritonclient.utils import InferenceServerException

    from cosyvoice_triton.voices.store import owner_tag

    a = register(stack, KEY_A, seed=21, id="myvoice")
    b = register(stack, KEY_B, seed=22, id="myvoice")
    assert a.status_code == 201, a.text
    assert b.status_code == 201 and "taken" not in b.text, b.text
    twin = register(stack, KEY_B, seed=21, id="a-twin")  # A's recording, as B's own voice
    assert twin.status_code == 201 and twin.json()["audio_sha256"] == a.json()["audio_sha256"] != \
        b.json()["audio_sha256"], twin.text
    for key, mine in ((KEY_A, a.json()), (KEY_B, b.json())):
        assert call(stack, "GET", "/v1/voices/myvoice", key).json()["audio_sha256"] == mine["audio_sha256"]
        listed = call(stack, "GET", "/v1/voices", key).json()["voices"]
        assert [v["audio_sha256"] for v in listed if v["id"] == "myvoice"] == [mine["audio_sha256"]]

    def same(x: np.ndarray, y: np.ndarray) -> bool:
        return x.shape == y.shape and float(np.max(np.abs(x - y))) <= 1e-4

    speakers = {
        "tts": lambda key, voice: sound(tts(stack, key, voice)),
        "ssml": lambda key, voice: sound(call(stack, "POST", "/v1/tts", key,
                                              json={"text": SSML.format(voice), "seed": 3})),
        "openai": lambda key, voice: sf.read(io.BytesIO(openai_speech(stack, key, voice).read()), dtype="float32")[0],
        "official": lambda key, voice: np.frombuffer(official_sft(stack, key, voice).content, "<i2") / 32768,
        "kserve": lambda key, voice: np.asarray(kserve(stack, key, voice).json()["outputs"][0]["data"], np.float32),
        "facade": lambda key, voice: facade(stack, key, voice),
    }
    for route, speak in speakers.items():
        a_mine, b_mine, b_twin = speak(KEY_A, "myvoice"), speak(KEY_B, "myvoice"), speak(KEY_B, "a-twin")
        assert same(a_mine, b_twin), route  # A's "myvoice" is A's recording
        assert not same(a_mine, b_mine), route  # B's "myvoice" is B's
    spoofed = np.asarray(kserve(stack, KEY_B, "myvoice", owner=owner_tag(KEY_A)).json()["outputs"][0]["data"],
                         np.float32)
    assert same(spoofed, speakers["kserve"](KEY_B, "myvoice"))
    assert same(facade(stack, KEY_B, "myvoice", owner=owner_tag(KEY_A)), speakers["facade"](KEY_B, "myvoice"))
    assert asyncio.run(ws_start(stack, KEY_B, "myvoice"))["audio_bytes"] > 0

    # B deletes its own; A's is neither B's to see, use nor delete
    assert call(stack, "DELETE", "/v1/voices/myvoice", KEY_B).json() == {"id": "myvoice", "deleted": True}
    for method in ("GET", "DELETE"):
        response = call(stack, method, "/v1/voices/myvoice", KEY_B)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found", response.text
    assert "myvoice" not in ids(stack, KEY_B)
    for response in (tts(stack, KEY_B, "myvoice"), call(stack, "POST", "/v1/tts", KEY_B,
                                                        json={"text": SSML.format("myvoice")}),
                     official_sft(stack, KEY_B, "myvoice"), kserve(stack, KEY_B, "myvoice", owner=owner_tag(KEY_A))):
        assert response.status_code == 404, response.text
    assert asyncio.run(ws_start(stack, KEY_B, "myvoice"))["status"] == 404
    with pytest.raises(openai.NotFoundError):
        openai_speech(stack, KEY_B, "myvoice")
    with pytest.raises(InferenceServerException) as error:
        facade(stack, KEY_B, "myvoice", owner=owner_tag(KEY_A))
    assert error.value.status() == "StatusCode.NOT_FOUND" or "not_found" in str(error.value), str(error.value)
    assert call(stack, "GET", "/v1/voices/myvoice", KEY_A).json()["audio_sha256"] == a.json()["audio_sha256"]
    assert same(speakers["tts"](KEY_A, "myvoice"), speakers["tts"](KEY_B, "a-twin"))
    for key in (KEY_A, KEY_B):  # the shared default stays everyone's
        assert tts(stack, key, "default").status_code == 200 and "default" in ids(stack, key)
    assert register(stack, KEY_A, seed=23, id="default").status_code == 400  # a shared id is nobody's to take
    for key, voice in ((KEY_A, "myvoice"), (KEY_B, "a-twin")):
        assert call(stack, "DELETE", f"/v1/voices/{voice}", key).status_code == 200
