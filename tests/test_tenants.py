"""Tenants: voices belong to the owner (API key) that registered them; shared voices are everyone's.

The store keeps an owner tag per voice (SQLite and Redis, old data migrated as shared); the gateway
scopes listing, use and deletion by key, over HTTP, WebSocket and the OpenAI route (tests further down).
"""
from __future__ import annotations

import json
import sqlite3

import pytest
import redis

from cosyvoice_triton.runtime.voice_store import (content_key, generated_voice_id, open_voice_store,
                                                  register_once, visible_to)
from cosyvoice_triton.runtime.voice_store_redis import CONTENT_KEY, IDS_KEY, voice_key
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
