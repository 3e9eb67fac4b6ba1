"""Voice store on Redis, for several servers that share voices.

Keys (standalone Redis or a primary with replicas; not Redis Cluster, whose slots would split them), each voice
under its store key (`store.store_key`: the id of a shared voice, "owner/id" of an owned one):
  cosyvoice:voice:<store key>   hash: revision, blob (`encode_voice`: the features of each family), families
                                (`families_text` of the blob's; absent: written before, see the blob), info
                                (VoiceRecord as JSON, but for its families and has_recording), content_key,
                                recording (`encode_recording`; absent: none kept) (an info written before voices
                                had owners lacks "owner": a shared voice)
  cosyvoice:voice_ids           set of every store key, for listing
  cosyvoice:voice_by_content    hash: content_key (sha256 of audio hash + text [+ owner]) → store key
  cosyvoice:voice_keys          "owner/id": owned voices are kept under their store key (absent: written before,
                                when ids were one space for all owners and owned voices were kept under their id)
Registration, deletion, a family's features added to a voice (written only while its revision is the one
read), a recording kept with a voice that has none and the move of an old owned voice to its store key are Lua
scripts, so each is one atomic step for
every server at once. Opening a store moves the old owned voices (once: it then sets
cosyvoice:voice_keys; servers opening it together move each voice once).
A lost connection or a timeout raises `Unavailable` (UNAVAILABLE / HTTP 503); other Redis errors propagate.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from cosyvoice_triton.errors import Unavailable
from cosyvoice_triton.messages import PromptFeatures
from cosyvoice_triton.voices.store import (FIRST_FAMILY, CachedVoiceStore, Recording, VoiceRecord, check_owner,
                                           check_same_voice, content_key, decode_voice, families_text, id_taken,
                                           lookup_keys, prepare_registration, split_families, store_key, visible_to)

PREFIX = "cosyvoice:"
IDS_KEY = PREFIX + "voice_ids"
CONTENT_KEY = PREFIX + "voice_by_content"
LAYOUT_KEY = PREFIX + "voice_keys"
LAYOUT = "owner/id"

# KEYS: the voice hash of the new voice's store key, content map, key set, then the voice hashes that must be
# free (its owner's and, for an owned voice, the shared one of that id).
# ARGV: store key, content_key, revision, blob, info JSON, prefix of voice hashes, recording ("" for none),
# families.
# → {"exists", info JSON and store key of the voice with this content} | {"taken", info JSON of the voice holding
#   the id} | {"created", ""}
REGISTER_LUA = """
local existing = redis.call('HGET', KEYS[2], ARGV[2])
if existing then
    return {'exists', redis.call('HGET', ARGV[6] .. existing, 'info'), existing}
end
for i = 4, #KEYS do
    local taken = redis.call('HGET', KEYS[i], 'info')
    if taken then
        return {'taken', taken}
    end
end
redis.call('HSET', KEYS[1], 'revision', ARGV[3], 'blob', ARGV[4], 'info', ARGV[5], 'content_key', ARGV[2],
           'families', ARGV[8])
if ARGV[7] ~= '' then
    redis.call('HSET', KEYS[1], 'recording', ARGV[7])
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
return {'created', ''}
"""

# KEYS: voice hash. ARGV: the revision read, the new revision, the new blob, its families. → 1 if written, 0 if
# the voice changed (or went) since it was read.
REPLACE_LUA = """
if redis.call('HGET', KEYS[1], 'revision') ~= ARGV[1] then
    return 0
end
redis.call('HSET', KEYS[1], 'revision', ARGV[2], 'blob', ARGV[3], 'families', ARGV[4])
return 1
"""

# KEYS: voice hash. ARGV: the recording. → 1 if kept, 0 if the voice has one already (or is gone).
KEEP_RECORDING_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
    return 0
end
return redis.call('HSETNX', KEYS[1], 'recording', ARGV[1])
"""

# KEYS: voice hash, content map, key set. ARGV: store key. → 1 if deleted, 0 if there was no such voice.
DELETE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
    return 0
end
local content = redis.call('HGET', KEYS[1], 'content_key')
redis.call('DEL', KEYS[1])
if content and redis.call('HGET', KEYS[2], content) == ARGV[1] then
    redis.call('HDEL', KEYS[2], content)
end
redis.call('SREM', KEYS[3], ARGV[1])
return 1
"""

# An owned voice kept under its id (before per-owner ids) moved to its store key.
# KEYS: old voice hash, new voice hash, content map, key set. ARGV: old key (the id), new key (owner/id).
# → 1 if moved, 0 if it was moved already (or deleted)
MOVE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 1 then
    return 0
end
redis.call('RENAME', KEYS[1], KEYS[2])
local content = redis.call('HGET', KEYS[2], 'content_key')
if content and redis.call('HGET', KEYS[3], content) == ARGV[1] then
    redis.call('HSET', KEYS[3], content, ARGV[2])
end
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[2])
return 1
"""


def voice_key(key: str) -> str:
    """The Redis key of the voice at store key `key`."""
    return f"{PREFIX}voice:{key}"


class RedisVoiceStore(CachedVoiceStore):
    """Voices in Redis at `url` ("redis://host:port/db"), with an LRU of decoded voices in front."""

    def __init__(self, url: str, *, lru_size: int = 256, timeout_s: float = 5.0):
        super().__init__(lru_size)
        # Bounded waits so a lost Redis fails requests instead of hanging them; url query arguments
        # (?socket_timeout=...) take precedence over these.
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._redis.ping()  # fail when the server starts, not at its first request
        self._register_script = self._redis.register_script(REGISTER_LUA)
        self._delete_script = self._redis.register_script(DELETE_LUA)
        self._replace_script = self._redis.register_script(REPLACE_LUA)
        self._keep_recording_script = self._redis.register_script(KEEP_RECORDING_LUA)
        self._move_script = self._redis.register_script(MOVE_LUA)
        self._move_old_owned_voices()

    def _move_old_owned_voices(self) -> None:
        """Owned voices kept under their id (written before per-owner ids) move to their store key, once."""
        if self._redis.get(LAYOUT_KEY) == LAYOUT.encode():
            return
        old = sorted(member.decode() for member in self._redis.smembers(IDS_KEY) if b"/" not in member)
        pipe = self._redis.pipeline(transaction=False)
        for key in old:
            pipe.hget(voice_key(key), "info")
        for key, raw in zip(old, pipe.execute()):
            owner = _info_from_json(raw).owner if raw is not None else None
            if owner is not None:
                new = store_key(key, owner)
                self._move_script(keys=[voice_key(key), voice_key(new), CONTENT_KEY, IDS_KEY], args=[key, new])
        self._redis.set(LAYOUT_KEY, LAYOUT)

    def register(self, features: PromptFeatures, voice_id: str | None = None, name: str | None = None,
                 owner: str | None = None, *, family: str = FIRST_FAMILY,
                 recording: Recording | None = None) -> VoiceRecord:
        """Store a voice (`family`'s features, and its recording), or return the one `owner` already stored for
        this recording and prompt text."""
        reg = prepare_registration(features, voice_id, name, owner, family, recording)
        info = reg.info
        must_be_free = [voice_key(key) for key in lookup_keys(info.voice_id, owner)]  # its owner's id, the shared
        with _unavailable_when_unreachable():
            status, existing, *found_key = self._register_script(
                keys=[voice_key(info.store_key), CONTENT_KEY, IDS_KEY, *must_be_free],
                args=[info.store_key, reg.content_key, reg.revision, reg.blob, _info_json(info), voice_key(""),
                      reg.recording or b"", families_text(info.families)])
        if status == b"exists":  # its whole record (as it was, if deleted since)
            found = self._info(found_key[0].decode()) or _info_from_json(existing)
            check_same_voice(voice_id, found.voice_id)
            return found if recording is None else self.keep_recording(found, recording)
        if status == b"taken":
            raise id_taken(info.voice_id, owner, _info_from_json(existing))
        self._remember(info.store_key, reg.revision, decode_voice(reg.blob, info.voice_id))
        return info

    def find(self, audio_sha256: str, text: str, owner: str | None = None) -> VoiceRecord | None:
        """`owner`'s voice with this recording and transcript, whatever its id; None if there is none."""
        with _unavailable_when_unreachable():
            key = self._redis.hget(CONTENT_KEY, content_key(audio_sha256, text, check_owner(owner)))
        return self._info(key.decode()) if key is not None else None  # None too if deleted in between

    def list(self, owner: str | None = None) -> list[VoiceRecord]:
        """The voices `owner` sees (its own and the shared ones; None: the shared ones), oldest first."""
        mine = f"{check_owner(owner)}/"
        with _unavailable_when_unreachable():
            keys = sorted(key for key in (member.decode() for member in self._redis.smembers(IDS_KEY))
                          if "/" not in key or (owner is not None and key.startswith(mine)))
        # A voice deleted between the two calls has no info any more: leave it out.
        infos = [info for info in self._records(keys) if info is not None and visible_to(info, owner)]
        return sorted(infos, key=lambda info: (info.created_at, info.voice_id))

    def check(self) -> None:
        with _unavailable_when_unreachable():
            self._redis.ping()

    def close(self) -> None:
        self._redis.close()

    def _info(self, key: str) -> VoiceRecord | None:
        return self._records([key])[0]

    def _records(self, keys: list[str]) -> list[VoiceRecord | None]:
        """The record of the voice at each store key (None: there is none), in one round trip (and a blob read for
        a voice written before its families were kept beside it)."""
        with _unavailable_when_unreachable():
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(voice_key(key), ["info", "families"])
                pipe.hexists(voice_key(key), "recording")
            answers = pipe.execute()
        records = []
        for key, (raw, families), has_recording in zip(keys, answers[::2], answers[1::2]):
            record = None if raw is None else _info_from_json(raw)
            if record is not None:
                record = dataclasses.replace(record, has_recording=bool(has_recording),
                                             families=self._blob_families(key, record.voice_id) if families is None
                                             else split_families(families.decode()))
            records.append(record)
        return records

    def _revision(self, key: str) -> str | None:
        with _unavailable_when_unreachable():
            raw = self._redis.hget(voice_key(key), "revision")
        return raw.decode() if raw is not None else None

    def _read(self, key: str) -> tuple[str, bytes] | None:
        with _unavailable_when_unreachable():
            revision, blob = self._redis.hmget(voice_key(key), ["revision", "blob"])
        if revision is None:
            return None
        return revision.decode(), blob or b""  # no blob field: `decode_voice` calls it corrupt

    def _read_recording(self, key: str) -> bytes | None:
        with _unavailable_when_unreachable():
            return self._redis.hget(voice_key(key), "recording")

    def _replace(self, key: str, expected: str, revision: str, blob: bytes, families: tuple[str, ...]) -> bool:
        with _unavailable_when_unreachable():
            return self._replace_script(keys=[voice_key(key)],
                                        args=[expected, revision, blob, families_text(families)]) == 1

    def _keep_recording(self, key: str, recording: bytes) -> bool:
        with _unavailable_when_unreachable():
            return self._keep_recording_script(keys=[voice_key(key)], args=[recording]) == 1

    def _delete(self, key: str) -> bool:
        with _unavailable_when_unreachable():
            return self._delete_script(keys=[voice_key(key), CONTENT_KEY, IDS_KEY], args=[key]) == 1


@contextmanager
def _unavailable_when_unreachable() -> Iterator[None]:
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise Unavailable(f"the voice store (Redis) is unreachable: {exc}") from exc


def _info_json(info: VoiceRecord) -> str:
    """The voice's `info` field: its record but for what changes after registration (kept in fields of their own)."""
    record = dataclasses.asdict(info)
    for changing in ("families", "has_recording"):
        del record[changing]
    return json.dumps(record)


def _info_from_json(raw: bytes) -> VoiceRecord:
    return VoiceRecord(**json.loads(raw))  # no "owner" (written before owners): the default, None, shared
