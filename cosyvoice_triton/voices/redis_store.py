"""Voice store on Redis, for several servers that share voices.

Keys (standalone Redis or a primary with replicas; not Redis Cluster, whose slots would split them):
  cosyvoice:voice:<id>          hash: revision, blob (`encode_features`), info (VoiceRecord as JSON), content_key
                                (an info written before voices had owners lacks "owner": a shared voice)
  cosyvoice:voice_ids           set of every voice id, for listing
  cosyvoice:voice_by_content    hash: content_key (sha256 of audio hash + text) → voice id
Registration and deletion are Lua scripts, so each is one atomic step for every server at once.
A lost connection or a timeout raises `Unavailable` (UNAVAILABLE / HTTP 503); other Redis errors propagate.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from cosyvoice_triton.errors import NotFound, Unavailable
from cosyvoice_triton.messages import PromptFeatures
from cosyvoice_triton.voices.store import (CachedVoiceStore, VoiceRecord, check_same_voice, check_voice_id,
                                                  content_key, decode_features, id_taken, prepare_registration)

PREFIX = "cosyvoice:"
IDS_KEY = PREFIX + "voice_ids"
CONTENT_KEY = PREFIX + "voice_by_content"

# KEYS: voice hash of the id asked for, content map, id set.
# ARGV: id, content_key, revision, blob, info JSON, prefix of voice hashes.
# → {"exists", info JSON of the voice with this content} | {"taken", ""} | {"created", ""}
REGISTER_LUA = """
local existing = redis.call('HGET', KEYS[2], ARGV[2])
if existing then
    return {'exists', redis.call('HGET', ARGV[6] .. existing, 'info')}
end
if redis.call('EXISTS', KEYS[1]) == 1 then
    return {'taken', ''}
end
redis.call('HSET', KEYS[1], 'revision', ARGV[3], 'blob', ARGV[4], 'info', ARGV[5], 'content_key', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
return {'created', ''}
"""

# KEYS: voice hash, content map, id set. ARGV: id. → 1 if deleted, 0 if there was no such voice.
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


def voice_key(voice_id: str) -> str:
    return f"{PREFIX}voice:{voice_id}"


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

    def register(self, features: PromptFeatures, voice_id: str | None = None,
                 name: str | None = None, owner: str | None = None) -> VoiceRecord:
        """Store a voice, or return the one `owner` already stored for this recording and prompt text."""
        reg = prepare_registration(features, voice_id, name, owner)
        info = reg.info
        with _unavailable_when_unreachable():
            status, existing = self._register_script(
                keys=[voice_key(info.voice_id), CONTENT_KEY, IDS_KEY],
                args=[info.voice_id, reg.content_key, reg.revision, reg.blob,
                      json.dumps(dataclasses.asdict(info)), voice_key("")])
        if status == b"exists":
            found = _info_from_json(existing)
            check_same_voice(voice_id, found.voice_id)
            return found
        if status == b"taken":
            raise id_taken(info.voice_id)
        self._remember(info.voice_id, reg.revision, decode_features(reg.blob, info.voice_id))
        return info

    def info(self, voice_id: str) -> VoiceRecord:
        check_voice_id(voice_id)
        with _unavailable_when_unreachable():
            raw = self._redis.hget(voice_key(voice_id), "info")
        if raw is None:
            raise NotFound("reference_audio_id", f"no voice {voice_id!r} is registered")
        return _info_from_json(raw)

    def find(self, audio_sha256: str, text: str, owner: str | None = None) -> VoiceRecord | None:
        """`owner`'s voice with this recording and transcript, whatever its id; None if there is none."""
        with _unavailable_when_unreachable():
            voice_id = self._redis.hget(CONTENT_KEY, content_key(audio_sha256, text, owner))
            raw = self._redis.hget(voice_key(voice_id.decode()), "info") if voice_id is not None else None
        return _info_from_json(raw) if raw is not None else None  # None too if deleted in between

    def list(self) -> list[VoiceRecord]:
        """Every voice, oldest first."""
        with _unavailable_when_unreachable():
            ids = sorted(member.decode() for member in self._redis.smembers(IDS_KEY))
            pipe = self._redis.pipeline(transaction=False)
            for voice_id in ids:
                pipe.hget(voice_key(voice_id), "info")
            raws = pipe.execute()
        # A voice deleted between the two calls has no info any more: leave it out.
        infos = [_info_from_json(raw) for raw in raws if raw is not None]
        return sorted(infos, key=lambda info: (info.created_at, info.voice_id))

    def delete(self, voice_id: str) -> bool:
        """Remove a voice; False if there was none. Other instances see it at their next get."""
        check_voice_id(voice_id)
        with _unavailable_when_unreachable():
            deleted = self._delete_script(keys=[voice_key(voice_id), CONTENT_KEY, IDS_KEY], args=[voice_id])
        self._forget(voice_id)
        return deleted == 1

    def check(self) -> None:
        with _unavailable_when_unreachable():
            self._redis.ping()

    def close(self) -> None:
        self._redis.close()

    def _revision(self, voice_id: str) -> str | None:
        with _unavailable_when_unreachable():
            raw = self._redis.hget(voice_key(voice_id), "revision")
        return raw.decode() if raw is not None else None

    def _read(self, voice_id: str) -> tuple[str, bytes] | None:
        with _unavailable_when_unreachable():
            revision, blob = self._redis.hmget(voice_key(voice_id), ["revision", "blob"])
        if revision is None:
            return None
        return revision.decode(), blob or b""  # no blob field: `decode_features` calls it corrupt


@contextmanager
def _unavailable_when_unreachable() -> Iterator[None]:
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise Unavailable(f"the voice store (Redis) is unreachable: {exc}") from exc


def _info_from_json(raw: bytes) -> VoiceRecord:
    return VoiceRecord(**json.loads(raw))  # no "owner" (written before owners): the default, None, shared
