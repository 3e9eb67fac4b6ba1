"""Embedded voice store: one SQLite file, shared by the processes of one machine.

The Triton models and the gateway may open the same file. WAL mode lets readers run while a writer
writes; a registration checks and inserts inside one `BEGIN IMMEDIATE` transaction, so two
processes registering the same recording at once end with one voice. Not for network filesystems
(WAL needs shared memory between the processes): use Redis to share voices between machines.

Voices are rows keyed by their store key (`store.store_key`: the id of a shared voice, "owner/id" of an owned
one), so each owner has its own ids. Files of earlier versions are brought up to date when opened, inside one
write transaction (concurrent openers agree): a file without the `owner` column gains it (its voices are
shared), a file keyed by voice id alone is rebuilt keyed by store key (its owned voices keep their ids), a
file without the `recording` column gains it (its voices have none: they keep serving the family they have), and
one without the `families` column gains it (NULL: a voice's families are read from its blob).
"""
from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from cosyvoice_triton.messages import PromptFeatures
from cosyvoice_triton.voices.store import (FIRST_FAMILY, CachedVoiceStore, Recording, Registration, VoiceRecord,
                                           check_owner, check_same_voice, content_key, decode_voice, families_text,
                                           id_taken, lookup_keys, prepare_registration, split_families)

COLUMNS = """
    store_key    TEXT PRIMARY KEY,      -- `store_key`: voice_id (shared) or owner/voice_id
    voice_id     TEXT NOT NULL,         -- the id on the wire, one owner's (or the shared) id space
    content_key  TEXT NOT NULL UNIQUE,  -- sha256(audio_sha256 + text [+ owner]): what registration is idempotent by
    revision     TEXT NOT NULL,         -- random per registration: lets every LRU spot a stale copy
    text         TEXT NOT NULL,
    audio_sha256 TEXT NOT NULL,
    tokens       INTEGER NOT NULL,
    created_at   REAL NOT NULL,
    name         TEXT,
    blob         BLOB NOT NULL,         -- `encode_voice`: the features of each family
    owner        TEXT,                  -- tenant tag; NULL: a shared voice
    recording    BLOB,                  -- `encode_recording`; NULL: none kept (imported, or stored before)
    families     TEXT                   -- `families_text` of the blob's families; NULL: stored before, see the blob
"""
SCHEMA = f"CREATE TABLE IF NOT EXISTS voices ({COLUMNS})"
RECORD_COLUMNS = "voice_id, text, audio_sha256, tokens, created_at, name, owner"  # VoiceRecord's first fields
INFO_COLUMNS = f"{RECORD_COLUMNS}, families, recording IS NOT NULL"  # and the rest (`_record`)
# A file keyed by voice id alone (before per-owner ids) copied into the current table, owned voices under owner/id.
REKEY = (
    f"CREATE TABLE voices_keyed ({COLUMNS})",
    "INSERT INTO voices_keyed (store_key, voice_id, content_key, revision, text, audio_sha256, tokens, created_at, "
    "name, blob, owner) SELECT CASE WHEN owner IS NULL THEN voice_id ELSE owner || '/' || voice_id END, voice_id, "
    "content_key, revision, text, audio_sha256, tokens, created_at, name, blob, owner FROM voices",
    "DROP TABLE voices",
    "ALTER TABLE voices_keyed RENAME TO voices",
)


class SqliteVoiceStore(CachedVoiceStore):
    """Voices in one SQLite file (created with its folders), with an LRU of decoded voices in front."""

    def __init__(self, path: str | Path, *, lru_size: int = 256, busy_timeout_s: float = 30.0):
        super().__init__(lru_size)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit: every statement is its own transaction unless `_transaction` opens one.
        # One connection shared by this process's threads, serialized by `_db_lock`.
        self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        self._db_lock = threading.Lock()
        self._switch_to_wal(busy_timeout_s)
        self._query(SCHEMA)
        self._migrate()

    def _switch_to_wal(self, timeout_s: float) -> None:
        """WAL mode, retried while another process holds the file: a server's models open a new file together,
        and SQLite answers the first switch 'database is locked' at once, without its busy wait."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                mode = self._query("PRAGMA journal_mode=WAL")[0][0]
                break
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        if mode != "wal":
            raise RuntimeError(f"{self.path}: SQLite could not switch to WAL mode (got {mode!r})")

    def _migrate(self) -> None:
        """Bring a file of an earlier version up to date (the module docstring), in one write transaction."""
        with self._transaction() as db:
            columns = {row[1] for row in db.execute("PRAGMA table_info(voices)").fetchall()}
            if "owner" not in columns:
                db.execute("ALTER TABLE voices ADD COLUMN owner TEXT")
            if "store_key" not in columns:
                for statement in REKEY:  # one by one: executescript would commit the transaction first
                    db.execute(statement)
                return  # (the rebuilt table has every column)
            for column, kind in (("recording", "BLOB"), ("families", "TEXT")):
                if column not in columns:
                    db.execute(f"ALTER TABLE voices ADD COLUMN {column} {kind}")

    def register(self, features: PromptFeatures, voice_id: str | None = None, name: str | None = None,
                 owner: str | None = None, *, family: str = FIRST_FAMILY,
                 recording: Recording | None = None) -> VoiceRecord:
        """Store a voice (`family`'s features, and its recording), or return the one `owner` already stored for
        this recording and prompt text."""
        reg = prepare_registration(features, voice_id, name, owner, family, recording)
        info = reg.info
        with self._transaction() as db:
            existing = db.execute(f"SELECT {INFO_COLUMNS} FROM voices WHERE content_key = ?",
                                  (reg.content_key,)).fetchall()
            if not existing:
                self._insert(db, reg)
        if existing:  # (its record read outside the transaction: an old one's families come from its blob)
            found = self._record(existing[0])
            check_same_voice(voice_id, found.voice_id)
            return found if recording is None else self.keep_recording(found, recording)
        self._remember(info.store_key, reg.revision, decode_voice(reg.blob, info.voice_id))
        return info

    @staticmethod
    def _insert(db: sqlite3.Connection, reg: Registration) -> None:
        """Write a new voice, unless its id is taken in its owner's space or among the shared ones (`id_taken`)."""
        info = reg.info
        for key in lookup_keys(info.voice_id, info.owner):
            taken = db.execute(f"SELECT {RECORD_COLUMNS} FROM voices WHERE store_key = ?", (key,)).fetchall()
            if taken:
                raise id_taken(info.voice_id, info.owner, VoiceRecord(*taken[0]))
        db.execute("INSERT INTO voices (store_key, voice_id, content_key, revision, text, audio_sha256, tokens, "
                   "created_at, name, blob, owner, recording, families) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (info.store_key, info.voice_id, reg.content_key, reg.revision, info.text, info.audio_sha256,
                    info.tokens, info.created_at, info.name, reg.blob, info.owner, reg.recording,
                    families_text(info.families)))

    def find(self, audio_sha256: str, text: str, owner: str | None = None) -> VoiceRecord | None:
        """`owner`'s voice with this recording and transcript, whatever its id; None if there is none."""
        rows = self._query(f"SELECT {INFO_COLUMNS} FROM voices WHERE content_key = ?",
                           (content_key(audio_sha256, text, check_owner(owner)),))
        return self._record(rows[0]) if rows else None

    def list(self, owner: str | None = None) -> list[VoiceRecord]:
        """The voices `owner` sees (its own and the shared ones; None: the shared ones), oldest first."""
        check_owner(owner)
        rows = self._query(f"SELECT {INFO_COLUMNS} FROM voices WHERE owner IS NULL OR owner = ? "
                           "ORDER BY created_at, voice_id", (owner,))
        return [self._record(row) for row in rows]

    def check(self) -> None:
        self._query("SELECT 1 FROM voices LIMIT 1")

    def close(self) -> None:
        with self._db_lock:
            self._db.close()

    def _info(self, key: str) -> VoiceRecord | None:
        rows = self._query(f"SELECT {INFO_COLUMNS} FROM voices WHERE store_key = ?", (key,))
        return self._record(rows[0]) if rows else None

    def _record(self, row: tuple) -> VoiceRecord:
        """The record of an INFO_COLUMNS row (families NULL: stored before they were kept, read from the blob)."""
        *fields, families, has_recording = row
        record = VoiceRecord(*fields, has_recording=bool(has_recording))
        return replace(record, families=self._blob_families(record.store_key, record.voice_id) if families is None
                       else split_families(families))

    def _revision(self, key: str) -> str | None:
        rows = self._query("SELECT revision FROM voices WHERE store_key = ?", (key,))
        return rows[0][0] if rows else None

    def _read(self, key: str) -> tuple[str, bytes] | None:
        rows = self._query("SELECT revision, blob FROM voices WHERE store_key = ?", (key,))
        return (rows[0][0], rows[0][1]) if rows else None

    def _read_recording(self, key: str) -> bytes | None:
        rows = self._query("SELECT recording FROM voices WHERE store_key = ?", (key,))
        return rows[0][0] if rows else None

    def _replace(self, key: str, expected: str, revision: str, blob: bytes, families: tuple[str, ...]) -> bool:
        with self._db_lock:
            return self._db.execute("UPDATE voices SET blob = ?, revision = ?, families = ? WHERE store_key = ? AND "
                                    "revision = ?", (blob, revision, families_text(families), key, expected)
                                    ).rowcount == 1

    def _keep_recording(self, key: str, recording: bytes) -> bool:
        with self._db_lock:
            return self._db.execute("UPDATE voices SET recording = ? WHERE store_key = ? AND recording IS NULL",
                                    (recording, key)).rowcount == 1

    def _delete(self, key: str) -> bool:
        with self._db_lock:
            return self._db.execute("DELETE FROM voices WHERE store_key = ?", (key,)).rowcount > 0

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        # fetchall: a half-read cursor would keep its read snapshot open and later reads would be stale.
        with self._db_lock:
            return self._db.execute(sql, args).fetchall()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """IMMEDIATE takes the file's write lock at BEGIN, so no other process can write between
        our checks and our insert (a DEFERRED transaction could fail to upgrade its lock)."""
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
