"""Voice store behaviour, on the embedded SQLite backend and on a real Redis (see redis_harness.py)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import sqlite3
import struct
import threading
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from cosyvoice_triton.errors import InvalidInput, NotFound, Unavailable
from cosyvoice_triton.messages import PromptFeatures
from cosyvoice_triton.preprocess.voice_features import audio_sha256
from cosyvoice_triton.voices.store import (CorruptVoice, Recording, StoredVoice, VoiceStore, decode_voice, encode_voice,
                                           generated_voice_id, register_once)
from cosyvoice_triton.voices.stores import open_voice_store
from cosyvoice_triton.voices.redis_store import voice_key
from redis_harness import redis_binary_or_skip, redis_server, start_redis  # noqa: F401  (a fixture)

OpenStore = Callable[..., VoiceStore]


def make_features(seed: int = 0, n_tokens: int = 25, text: str = "希望你以后能够做的比我还好呦。"
                  ) -> PromptFeatures:
    rng = np.random.default_rng(seed)
    recording = rng.standard_normal(16000).astype(np.float32)
    embedding = rng.standard_normal(192).astype(np.float32)
    embedding[:3] = [np.nan, -0.0, np.inf]  # only a bitwise copy keeps these exactly
    return PromptFeatures(embedding=embedding,
                          speech_tokens=rng.integers(0, 6561, n_tokens).astype(np.int32),
                          mel=rng.standard_normal((2 * n_tokens, 80)).astype(np.float32),
                          text=text, audio_sha256=audio_sha256(recording, 16000))


def assert_same_features(got: PromptFeatures, want: PromptFeatures) -> None:
    for name in ("embedding", "speech_tokens", "mel"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert (got.text, got.audio_sha256) == (want.text, want.audio_sha256)


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path) -> str:
    """One empty backing store per test: a new SQLite file, or the flushed test Redis."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'voices.sqlite'}"
    server = request.getfixturevalue("redis_server")
    server.flush()
    return server.url


@pytest.fixture
def open_store(store_url) -> Iterator[OpenStore]:
    """Opens store instances on the test's backing store (each like another process) and closes them."""
    stores: list[VoiceStore] = []

    def open_one(lru_size: int = 256) -> VoiceStore:
        stores.append(open_voice_store(store_url, lru_size=lru_size))
        return stores[-1]

    yield open_one
    for store in stores:
        store.close()


def overwrite_blob(url: str, voice_id: str, blob: bytes) -> None:
    """Damage a stored voice behind the store's back."""
    if url.startswith("redis://"):
        with redis.Redis.from_url(url) as client:
            client.hset(voice_key(voice_id), "blob", blob)
    else:
        with sqlite3.connect(url[len("sqlite://"):]) as db:
            db.execute("UPDATE voices SET blob = ? WHERE voice_id = ?", (blob, voice_id))


def test_round_trip_is_bitwise(open_store):
    writer, reader = open_store(), open_store()
    features = make_features()
    info = writer.register(features, name="Alice")
    assert (info.text, info.audio_sha256, info.name) == (features.text, features.audio_sha256, "Alice")
    assert info.tokens == 25
    for store in (writer, reader, reader):  # the writer's LRU, a cold read, a cached read
        got = store.get(info.voice_id)
        assert_same_features(got, features)
        assert not got.mel.flags.writeable  # cached arrays are shared between requests
    assert reader.info(info.voice_id) == info


def test_registration_is_idempotent(open_store):
    first, second = open_store(), open_store()
    features = make_features()
    info = first.register(features, name="Alice")
    expected_id = "v_" + hashlib.sha256((features.audio_sha256 + features.text).encode()).hexdigest()[:16]
    assert info.voice_id == expected_id
    assert first.register(features) == info
    assert second.register(make_features(), name="Bob") == info  # equal content from elsewhere: not rewritten
    assert first.register(features, voice_id=expected_id) == info
    assert second.list() == [info]


def test_same_recording_with_other_text_is_another_voice(open_store):
    store = open_store()
    a = store.register(make_features(text="one"))
    b = store.register(make_features(text="two"))
    assert a.audio_sha256 == b.audio_sha256 and a.voice_id != b.voice_id
    assert [info.voice_id for info in store.list()] == [a.voice_id, b.voice_id]


def test_explicit_ids(open_store):
    store, other = open_store(), open_store()
    alice = store.register(make_features(seed=1), voice_id="alice")
    assert alice.voice_id == "alice"
    assert other.register(make_features(seed=1), voice_id="alice") == alice
    assert other.register(make_features(seed=1)) == alice  # no id asked for: the existing voice
    with pytest.raises(InvalidInput) as taken:
        other.register(make_features(seed=2), voice_id="alice")
    assert taken.value.field == "voice_id" and "taken" in taken.value.problem
    with pytest.raises(InvalidInput) as elsewhere:
        other.register(make_features(seed=1), voice_id="bob")
    assert elsewhere.value.field == "voice_id" and "'alice'" in elsewhere.value.problem
    assert store.list() == [alice]


@pytest.mark.parametrize("good_id", ["中文女", "stimme-ü", "Speaker_01.v2"])
def test_ids_in_any_script_are_voice_ids(open_store, good_id):
    """The official saved speakers have names like 中文女: `voices import` keeps them as voice ids."""
    store = open_store()
    features = make_features()
    assert store.register(features, voice_id=good_id).voice_id == good_id
    np.testing.assert_array_equal(store.get(good_id).speech_tokens, features.speech_tokens)
    assert [v.voice_id for v in store.list()] == [good_id]


@pytest.mark.parametrize("bad_id", ["", "a b", "x" * 65, "a/b", "a:b", "a\u200bb", "中文 女", "v_0123456789abcdef", 7])
def test_bad_ids_are_rejected(open_store, bad_id):
    store = open_store()
    with pytest.raises(InvalidInput) as registered:
        store.register(make_features(), voice_id=bad_id)
    assert registered.value.field == "voice_id"
    if bad_id != "v_0123456789abcdef":  # reserved for registration, well-formed for a lookup
        with pytest.raises(InvalidInput) as looked_up:
            store.get(bad_id)
        assert looked_up.value.field == "reference_audio_id"
    assert store.list() == []


def test_malformed_features_are_rejected(open_store):
    store = open_store()
    good = make_features()
    bad = [dataclasses.replace(good, embedding=good.embedding.astype(np.float64)),
           dataclasses.replace(good, mel=good.mel[:-2]),
           dataclasses.replace(good, speech_tokens=good.speech_tokens[:0], mel=good.mel[:0]),
           dataclasses.replace(good, audio_sha256="not-a-hash")]
    for features in bad:
        with pytest.raises(ValueError):
            store.register(features)
    with pytest.raises(InvalidInput) as named:
        store.register(good, name="n" * 201)
    assert named.value.field == "name"
    assert store.list() == []


def test_unknown_and_deleted_ids_are_not_found(open_store):
    store = open_store()
    for lookup in (store.get, store.info):
        with pytest.raises(NotFound) as unknown:
            lookup("nobody")
        assert unknown.value.field == "reference_audio_id"
    assert store.delete("nobody") is False
    info = store.register(make_features())
    store.get(info.voice_id)  # now in the LRU
    assert store.delete(info.voice_id) is True
    with pytest.raises(NotFound):
        store.get(info.voice_id)
    with pytest.raises(NotFound):
        store.info(info.voice_id)
    assert store.list() == [] and store.delete(info.voice_id) is False


def test_instances_see_each_others_registrations_and_deletions(open_store):
    a, b = open_store(), open_store()
    alice = a.register(make_features(seed=1), voice_id="alice")
    assert_same_features(b.get("alice"), make_features(seed=1))  # b now caches alice
    assert b.list() == [alice]
    assert a.delete("alice")
    with pytest.raises(NotFound):
        b.get("alice")  # b's cached copy is not served
    assert b.list() == []
    # The id comes back with another recording: b must not serve what it read before.
    b.get(a.register(make_features(seed=3)).voice_id)
    a.register(make_features(seed=2), voice_id="alice")
    assert_same_features(b.get("alice"), make_features(seed=2))
    a.delete("alice")
    a.register(make_features(seed=1), voice_id="alice")  # same content as the first time, new revision
    assert_same_features(b.get("alice"), make_features(seed=1))
    assert b.delete("alice") and a.list() == b.list() and len(a.list()) == 1


def test_concurrent_registrations_make_one_voice(open_store):
    stores = [open_store() for _ in range(4)]
    results: list = [None] * len(stores)

    def register(i: int) -> None:
        results[i] = stores[i].register(make_features())

    threads = [threading.Thread(target=register, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(info == results[0] for info in results)
    assert stores[0].list() == [results[0]]


def _register_in_child(path: str, seeds: list[int]) -> None:
    store = open_voice_store(path)
    for seed in seeds:
        store.register(make_features(seed=seed))
    store.close()


def test_sqlite_processes_share_one_file(tmp_path):
    path = str(tmp_path / "voices.sqlite")
    parent = open_voice_store(path)
    parent.get(parent.register(make_features(seed=0)).voice_id)
    # Spawned, not forked: this process has gRPC and torch threads by now, and fork() copies their locks
    # mid-call. Both children register seed 1, each one of its own too.
    spawn = multiprocessing.get_context("spawn")
    children = [spawn.Process(target=_register_in_child, args=(path, seeds)) for seeds in ([1, 2, 0], [1, 3])]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=60)
    assert [child.exitcode for child in children] == [0, 0]
    voices = parent.list()
    expected = [make_features(seed=seed) for seed in range(4)]
    assert sorted(info.voice_id for info in voices) == sorted(
        generated_voice_id(features.audio_sha256, features.text) for features in expected)
    for info in voices:
        assert parent.get(info.voice_id).audio_sha256 == info.audio_sha256
    parent.close()


def test_sqlite_voices_survive_reopening(tmp_path):
    path = tmp_path / "home" / "voices.sqlite"  # folders are created
    store = open_voice_store(str(path))
    info = store.register(make_features(), name="Alice")
    store.close()
    reopened = open_voice_store(f"sqlite://{path}")
    assert reopened.list() == [info]
    assert_same_features(reopened.get(info.voice_id), make_features())
    reopened.close()


def test_default_store_lives_under_cosyvoice_home(tmp_path, monkeypatch):
    monkeypatch.setenv("COSYVOICE_HOME", str(tmp_path / "home"))
    store = open_voice_store(None)
    store.register(make_features())
    store.close()
    assert (tmp_path / "home" / "voices.sqlite").is_file()
    with pytest.raises(ValueError, match="mysql"):
        open_voice_store("mysql://db/voices")


def test_corrupt_blob_is_a_clear_error(open_store, store_url):
    store = open_store()
    bad = store.register(make_features(seed=1))
    good = store.register(make_features(seed=2))
    overwrite_blob(store_url, bad.voice_id, b"\x00garbage")
    reader = open_store()
    with pytest.raises(CorruptVoice, match=bad.voice_id):
        reader.get(bad.voice_id)
    # The damage left the revision as it was: the writer's copy, decoded at registration, still serves.
    assert_same_features(store.get(bad.voice_id), make_features(seed=1))
    assert_same_features(reader.get(good.voice_id), make_features(seed=2))  # the store keeps serving
    assert reader.delete(bad.voice_id)
    assert reader.register(make_features(seed=1)).voice_id == bad.voice_id
    assert_same_features(store.get(bad.voice_id), make_features(seed=1))


def _flip_bit(blob: bytes, index: int) -> bytes:
    damaged = bytearray(blob)
    damaged[index] ^= 0x01
    return bytes(damaged)


@pytest.mark.parametrize("damage", [
    lambda blob: b"",
    lambda blob: blob[:-4],  # truncated
    lambda blob: blob + b"\x00" * 4,  # extended
    lambda blob: _flip_bit(blob, -5),  # in the mel
    lambda blob: _flip_bit(blob, 20),  # in the JSON header
    lambda blob: b"PK\x03\x04" + blob[4:],  # another format (npz)
    lambda blob: blob[:4] + b"\x03\x00" + blob[6:],  # a newer version
    lambda blob: b"\x80\x04\x95" + blob[3:],  # a pickle
], ids=["empty", "truncated", "extended", "mel bit", "header bit", "npz", "version", "pickle"])
def test_blob_decoder_rejects_damage(damage):
    blob = encode_voice(StoredVoice.of(make_features(), "cosyvoice2"))
    assert_same_features(decode_voice(blob, "v").features["cosyvoice2"], make_features())
    with pytest.raises(CorruptVoice, match="'v'"):
        decode_voice(damage(blob), "v")


def test_stats_count_hits_misses_and_loads(open_store):
    writer, reader = open_store(), open_store(lru_size=1)
    a = writer.register(make_features(seed=1))
    b = writer.register(make_features(seed=2))
    assert reader.stats.hits == reader.stats.misses == reader.stats.loads == reader.stats.size == 0
    reader.get(a.voice_id)
    reader.get(a.voice_id)
    with pytest.raises(NotFound):
        reader.get("nobody")
    assert (reader.stats.hits, reader.stats.misses, reader.stats.loads, reader.stats.size) == (1, 1, 1, 1)
    reader.get(b.voice_id)  # evicts a (lru_size=1)
    reader.get(a.voice_id)
    assert (reader.stats.hits, reader.stats.loads, reader.stats.size) == (1, 3, 1)
    writer.delete(a.voice_id)
    with pytest.raises(NotFound):
        reader.get(a.voice_id)  # a cached copy of a deleted voice is a miss, and is dropped
    assert (reader.stats.hits, reader.stats.misses, reader.stats.size) == (1, 2, 0)
    uncached = open_store(lru_size=0)
    uncached.get(b.voice_id)
    uncached.get(b.voice_id)
    assert (uncached.stats.hits, uncached.stats.loads, uncached.stats.size) == (0, 2, 0)


def test_lost_redis_is_unavailable(tmp_path):
    server = start_redis(redis_binary_or_skip(), tmp_path)  # its own server: this test kills it
    try:
        store = open_voice_store(server.url)
        info = store.register(make_features())
        store.get(info.voice_id)
    finally:
        server.stop()
    for call in (lambda: store.get(info.voice_id), store.list, lambda: store.register(make_features(seed=1))):
        with pytest.raises(Unavailable, match="unreachable"):
            call()
    store.close()


def test_register_once_encodes_only_new_content(open_store):
    """A repeat registration (same recording, same transcript) is a lookup: the encoder does not run."""
    store = open_store()
    features = make_features(text="a prompt")
    sha = features.audio_sha256
    encoded = []

    def encode(features=features):
        encoded.append(features.text)
        return features

    def must_not_encode():
        raise AssertionError("the encoder ran for content the store holds")

    info = register_once(store, sha, "a prompt", encode, name="Alice")
    assert encoded == ["a prompt"]
    assert register_once(store, sha, "a prompt", must_not_encode) == info
    assert open_store().find(sha, "a prompt") == info  # another process finds it too
    # The key is audio hash + transcript: the same recording with another transcript is another voice.
    other = dataclasses.replace(make_features(seed=1, text="another transcript"), audio_sha256=sha)
    bob = register_once(store, sha, "another transcript", lambda: encode(other), voice_id="bob")
    assert bob.voice_id == "bob" != info.voice_id and encoded == ["a prompt", "another transcript"]
    # Found by content key under an explicit id too; asking for another id is refused, as register does.
    assert register_once(store, sha, "another transcript", must_not_encode) == bob
    with pytest.raises(InvalidInput, match="voice_id.*already registered as voice 'bob'"):
        register_once(store, sha, "another transcript", must_not_encode, voice_id="robert")
    with pytest.raises(InvalidInput, match="voice_id"):
        register_once(store, sha, "a prompt", must_not_encode, voice_id="not an id!")
    assert store.find(sha, "a third transcript") is None
    assert store.delete("bob") and store.find(sha, "another transcript") is None


def _open_store_at(path: str, barrier) -> str:
    from cosyvoice_triton.voices.sqlite_store import SqliteVoiceStore

    barrier.wait()
    store = SqliteVoiceStore(path)
    store.close()
    return "ok"


def test_processes_opening_a_new_sqlite_file_at_once_all_open_it(tmp_path):
    """A server's models open the voice store together at start; the first open of a new file switches it
    to WAL, which SQLite refuses at once (no busy wait) while another process has the file open."""
    context = multiprocessing.get_context("spawn")
    for attempt in range(3):
        path = str(tmp_path / f"voices{attempt}.db")
        with context.Manager() as manager:
            barrier = manager.Barrier(6)
            with context.Pool(6) as pool:
                results = pool.starmap(_open_store_at, [(path, barrier)] * 6)
        assert results == ["ok"] * 6


# ---- one voice, every model family ----------------------------------------------------------------------

RECORDING = Recording(np.random.default_rng(7).standard_normal(24000).astype(np.float32), 16000)


class Encoder:
    """Stands in for a server's prompt encoder of one family: its features for a recording, each call counted."""

    def __init__(self, seed: int):
        self.seed, self.calls = seed, []

    def __call__(self, samples: np.ndarray, sample_rate: int, text: str, sha: str) -> PromptFeatures:
        self.calls.append((samples.tobytes(), sample_rate, text, sha))
        return dataclasses.replace(make_features(seed=self.seed, n_tokens=30, text=text), audio_sha256=sha)


def must_not_encode(*_args) -> PromptFeatures:
    raise AssertionError("the encoder ran for features the store holds")


def test_a_voice_gets_another_familys_features_from_its_recording_once(open_store):
    """Registered with CosyVoice2's features and its recording; CosyVoice3's are made at their first get from the
    recording as registered, kept, and read by every instance after that; CosyVoice2's stay as they were."""
    first, other = open_store(), open_store()
    cv2 = make_features(seed=1)
    info = first.register(cv2, voice_id="both", family="cosyvoice2", recording=RECORDING)
    first.get("both")  # cached before the other family's features exist
    cv3 = Encoder(seed=2)
    got = first.get("both", family="cosyvoice3", encode=cv3)
    assert cv3.calls == [(RECORDING.samples.tobytes(), RECORDING.sample_rate, cv2.text, cv2.audio_sha256)]
    assert_same_features(got, cv3(RECORDING.samples, 16000, cv2.text, cv2.audio_sha256))
    assert (info.families, info.has_recording) == (("cosyvoice2",), True)
    both = dataclasses.replace(info, families=("cosyvoice2", "cosyvoice3"))  # what the record says from now on
    for store in (other, first, open_store()):
        assert_same_features(store.get("both", family="cosyvoice3", encode=must_not_encode), got)
        assert_same_features(store.get("both", family="cosyvoice2", encode=must_not_encode), cv2)
        assert store.info("both") == both and store.list() == [both]
    assert not other.get("both", family="cosyvoice3").mel.flags.writeable


def test_families_made_at_once_by_two_instances_are_both_kept(open_store):
    """Two instances add a family each to one voice at the same moment (b writes while a computes): a's write
    reads the voice after computing and lands only on the revision it read, so b's family stays."""
    a, b = open_store(), open_store()
    a.register(make_features(seed=1), voice_id="busy", recording=RECORDING)
    made_by_b = Encoder(seed=4)

    def encode_while_b_writes(*args) -> PromptFeatures:  # b writes its family between a's read and a's write
        b.get("busy", family="fam_b", encode=made_by_b)
        return Encoder(seed=3)(*args)

    a.get("busy", family="fam_a", encode=encode_while_b_writes)
    reader = open_store()
    for family, seed in (("fam_a", 3), ("fam_b", 4), ("cosyvoice2", 1)):
        assert reader.get("busy", family=family).speech_tokens.tobytes() == (
            make_features(seed=seed, n_tokens=30 if seed != 1 else 25).speech_tokens.tobytes())
    assert len(made_by_b.calls) == 1


def test_a_voice_without_a_recording_serves_its_own_family_only(open_store):
    store = open_store()
    imported = store.register(make_features(seed=1), voice_id="imported", family="cosyvoice3")  # spk2info: none kept
    assert (imported.families, imported.has_recording) == (("cosyvoice3",), False)
    assert_same_features(store.get("imported", family="cosyvoice3"), make_features(seed=1))
    with pytest.raises(InvalidInput, match="cosyvoice3 features only.*register its recording again") as lacking:
        store.get("imported", family="cosyvoice2", encode=must_not_encode)
    assert lacking.value.field == "reference_audio_id"
    store.register(make_features(seed=2), voice_id="kept", recording=RECORDING)
    with pytest.raises(InvalidInput, match="no cosyvoice3 features yet"):
        store.get("kept", family="cosyvoice3")  # no encoder to make them with


def version_1_blob(features: PromptFeatures) -> bytes:
    """A voice as the store wrote it before it kept families (blob version 1: one family's arrays, unnamed)."""
    arrays = [("embedding", "<f4", features.embedding), ("speech_tokens", "<i4", features.speech_tokens),
              ("mel", "<f4", features.mel)]
    header = json.dumps({"text": features.text, "audio_sha256": features.audio_sha256,
                         "arrays": [[name, dtype, list(array.shape)] for name, dtype, array in arrays]},
                        ensure_ascii=False).encode()
    body = header + b"".join(array.astype(dtype).tobytes() for _, dtype, array in arrays)
    return struct.pack("<4sHII", b"CVVS", 1, len(header), zlib.crc32(body)) + body


def test_a_voice_stored_before_families_serves_cosyvoice2_as_before(open_store, store_url):
    store = open_store()
    old = make_features(seed=5)
    store.register(old, voice_id="old", recording=None)
    overwrite_blob(store_url, "old", version_1_blob(old))  # the revision stays: a cold reader decodes it
    reader = open_store()
    assert_same_features(reader.get("old"), old)
    assert_same_features(reader.get("old", family="cosyvoice2"), old)
    with pytest.raises(InvalidInput, match="register its recording again"):
        reader.get("old", family="cosyvoice3", encode=Encoder(seed=6))


def forget_families(url: str, key: str) -> None:
    """Make a voice's record as an earlier version wrote it: no families beside the blob."""
    if url.startswith("redis://"):
        with redis.Redis.from_url(url) as client:
            client.hdel(voice_key(key), "families")
    else:
        with sqlite3.connect(url[len("sqlite://"):]) as db:
            db.execute("UPDATE voices SET families = NULL WHERE store_key = ?", (key,))


def test_registering_its_recording_again_lets_an_old_voice_serve_every_family(open_store, store_url):
    """A voice stored before voices kept their recording (version 1 blob, no families beside it): its record says
    CosyVoice2 and no recording; CosyVoice3 asks for the recording; registering the same recording and transcript
    (any family's server, found by content, nothing encoded) keeps the recording with the voice, which keeps its
    id, record and CosyVoice2 features; CosyVoice3's are then made from that recording at their first get."""
    sha = audio_sha256(RECORDING.samples, RECORDING.sample_rate)
    old = dataclasses.replace(make_features(seed=5), audio_sha256=sha)
    stored = open_store().register(old, voice_id="old", name="Old", owner="key_a")
    overwrite_blob(store_url, "key_a/old", version_1_blob(old))
    forget_families(store_url, "key_a/old")
    reader = open_store()
    before = reader.info("old", "key_a")
    assert (before.families, before.has_recording) == (("cosyvoice2",), False)  # read from its blob
    assert reader.list("key_a") == [before]
    with pytest.raises(InvalidInput, match="register its recording again with the same transcript") as asked:
        reader.get("old", "key_a", family="cosyvoice3", encode=Encoder(seed=6))
    assert asked.value.field == "reference_audio_id" and asked.value.retry_after_s is None
    with pytest.raises(ValueError, match="another recording"):
        reader.keep_recording(before, Recording(RECORDING.samples[::2].copy(), RECORDING.sample_rate))

    again = register_once(open_store(), sha, old.text, must_not_encode, owner="key_a", family="cosyvoice3",
                          recording=RECORDING)
    assert again == dataclasses.replace(before, has_recording=True)
    assert (again.voice_id, again.created_at, again.name) == (stored.voice_id, stored.created_at, "Old")
    assert register_once(reader, sha, old.text, must_not_encode, owner="key_a", recording=RECORDING) == again
    cv3 = Encoder(seed=6)
    made = reader.get("old", "key_a", family="cosyvoice3", encode=cv3)
    assert cv3.calls == [(RECORDING.samples.tobytes(), RECORDING.sample_rate, old.text, sha)]
    assert_same_features(made, cv3(RECORDING.samples, RECORDING.sample_rate, old.text, sha))
    after = open_store()
    assert_same_features(after.get("old", "key_a", family="cosyvoice2", encode=must_not_encode), old)
    assert after.info("old", "key_a").families == ("cosyvoice2", "cosyvoice3")


def test_registering_the_recording_again_through_register_keeps_it_too(open_store):
    store = open_store()
    sha = audio_sha256(RECORDING.samples, RECORDING.sample_rate)
    features = dataclasses.replace(make_features(seed=5), audio_sha256=sha)
    first = store.register(features, voice_id="plain")  # none kept (as an import)
    again = open_store().register(features, recording=RECORDING, family="cosyvoice3")
    assert again == dataclasses.replace(first, has_recording=True)
    assert store.get("plain", family="cosyvoice3", encode=Encoder(seed=6)).speech_tokens.shape == (30,)


def test_an_sqlite_file_without_recordings_gains_the_column(tmp_path):
    """A file as the store wrote it before it kept recordings: opened, it gains the column; its voices (version 1
    blobs) serve CosyVoice2; new voices keep their recording."""
    path, old = tmp_path / "before.sqlite", make_features(seed=8)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE voices (store_key TEXT PRIMARY KEY, voice_id TEXT NOT NULL, content_key TEXT NOT NULL "
                   "UNIQUE, revision TEXT NOT NULL, text TEXT NOT NULL, audio_sha256 TEXT NOT NULL, tokens INTEGER NOT "
                   "NULL, created_at REAL NOT NULL, name TEXT, blob BLOB NOT NULL, owner TEXT)")
        db.execute("INSERT INTO voices VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   ("old", "old", "k" * 64, "r1", old.text, old.audio_sha256, 25, 0.0, None, version_1_blob(old), None))
    store = open_voice_store(f"sqlite://{path}")
    assert_same_features(store.get("old"), old)
    store.register(make_features(seed=9), voice_id="new", recording=RECORDING)
    assert store.get("new", family="cosyvoice3", encode=Encoder(seed=10)).speech_tokens.shape == (30,)
    store.close()
