"""Open the voice store a URL names: the embedded SQLite store (default) or the Redis store shared by servers.

Its own module so that the store kinds can import `store` (the protocol and the shared record code) without a
circle: `store` ← `sqlite_store`, `redis_store` ← `stores`.
"""
from __future__ import annotations

import os
from pathlib import Path

from .sqlite_store import SqliteVoiceStore
from .store import VoiceStore


def open_voice_store(url: str | None, *, lru_size: int = 256) -> VoiceStore:
    """Open the store that `url` names.

    None                         → embedded, $COSYVOICE_HOME/voices.sqlite (default ~/.cache/cosyvoice_triton)
    "sqlite:///abs/voices.sqlite" or a plain path → embedded SQLite file (folders are created)
    "redis://host:port/db" (or rediss://)          → Redis, shared between servers
    """
    # Redis is imported only when it is used.
    if url is not None and url.startswith(("redis://", "rediss://")):
        from .redis_store import RedisVoiceStore
        return RedisVoiceStore(url, lru_size=lru_size)
    return SqliteVoiceStore(_sqlite_path(url), lru_size=lru_size)


def _sqlite_path(url: str | None) -> Path:
    if url is None:
        home = Path(os.environ.get("COSYVOICE_HOME", "~/.cache/cosyvoice_triton")).expanduser()
        return home / "voices.sqlite"
    if url.startswith("sqlite://"):
        url = url[len("sqlite://"):]  # "sqlite:///abs/x.sqlite" → "/abs/x.sqlite"
    elif "://" in url:
        raise ValueError(f"voice store url {url!r}: use sqlite:///path, redis://host:port/db or a path")
    if not url:
        raise ValueError("voice store url names no file")
    return Path(url).expanduser()
