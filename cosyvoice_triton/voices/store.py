"""Voice store: `reference_audio_id` → the `PromptFeatures` computed once at registration.

```
store = open_voice_store(None)                  # embedded SQLite under $COSYVOICE_HOME
info = store.register(features, name="Alice")   # idempotent by (audio hash, prompt text)
features = store.get(info.voice_id)             # NotFound("reference_audio_id", ...) if absent
info = register_once(store, sha, text, encode)  # encode() runs only if (sha, text) is not stored yet
store.register(features, "alice", owner="key_3f9a")  # voice "alice" of one tenant (see Owners below)
store.get("alice", owner="key_3f9a")            # that tenant's "alice", else a shared one
```
Registration is idempotent by the *content key*: the recording's `audio_sha256` (its samples and
sample rate) together with the prompt transcript, exactly as given, and the voice's owner. The same
recording with another transcript is another prompt (zero_shot conditions the LLM on the transcript), so
another voice; the same recording and transcript registered again by the same owner return the stored
voice, whatever name is given.

Owners: every voice has an `owner`, an opaque tenant tag (the gateway uses a hash of the API key, never
the key), or None for a *shared* voice (`default`, voices an admin registers as shared, and every voice
stored before owners existed: old SQLite files gain the column on open, old Redis entries read as None).
Each owner has its own id space: tenant A's "myvoice" and tenant B's "myvoice" are two voices, and one
tenant can neither see nor learn of the other's. Shared voices are one more id space, seen by everyone:
a voice id is looked up for an owner in its own space first, then among the shared voices (`get`, `info`;
owner None: the shared ones only), so an owner registering an id that a shared voice uses is refused (that
id is public), while a shared voice registered later under an id some owner uses is hidden from that
owner by its own voice. Inside the store a voice is kept under its *store key* (`store_key`: the id for
a shared voice, "owner/id" for an owned one; neither part holds a "/"); the id on the wire stays the
voice's own. The Triton models get the owner with the id (the `owner` input), so the same lookup holds
there, SSML's <voice name> included. The content key, and so the generated id, include the owner, so two
tenants registering one recording get two voices.
Backends: `voice_store_sqlite` (default, one file, several processes on one machine) and
`voice_store_redis` (several servers share voices). Both keep a thread-safe LRU of decoded features
in front (`CachedVoiceStore`). Every get first asks the backing store for the voice's *revision*
(a random token written at registration: one indexed row or one HGET); the cached copy is used only
when it matches. So a voice deleted or re-registered through any other instance or process is never
served stale, and a hit costs one small lookup instead of moving and decoding the whole blob.

Families: a voice serves every model family (`family.ModelFamily.name`). What a family's folder computes from
the recording differs (the speech tokens: tokenizer v2 or v3; the prompt mel: CosyVoice3's reaches 12 kHz,
CosyVoice2's stops at 8 kHz; the embedding: the folder's own campplus.onnx), so a voice keeps one set of
`PromptFeatures` per family, and the recording itself (`Recording`, beside the features, never in the LRU).
`get(voice_id, owner, family, encode)` of a family the voice has no features for yet computes them from the
recording with `encode` (a server of that family's prompt encoder) and keeps them: the next get of any
instance reads them. A voice's record says which families it has features for (`families`, kept beside the blob
so that a listing reads no blob) and whether its recording is kept (`has_recording`). A voice stored before
families were kept (blob version 1) holds CosyVoice2's features (the only family served then) and no recording:
it serves CosyVoice2 as before; another family asks for its recording to be registered again, and registering
the same recording and transcript (found by its content key) keeps the recording with the voice, whose id and
features stay (`keep_recording`), so every family serves it from then on.

This module also holds the id rules and the blob format (versioned header + raw arrays, no pickle).
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cosyvoice_triton.errors import CosyVoiceError, InvalidInput, NotFound
from cosyvoice_triton.family import COSYVOICE2
from cosyvoice_triton.messages import PromptFeatures, voice_modes
from cosyvoice_triton.preprocess.voice_features import audio_sha256

EMBEDDING_DIM = 192
MEL_BINS = 80
TOKEN_MEL_RATIO = 2  # both families: two 50 Hz mel frames per 25 Hz speech token
MAX_NAME_CHARS = 200
# The family of the features of a voice stored before families were kept (blob version 1), and of a get or a
# registration that names none: the only family served then.
FIRST_FAMILY = COSYVOICE2.name
FAMILY_PATTERN = re.compile(r"[a-z0-9_]{1,32}")
COMPLETE_TRIES = 5  # read-modify-writes of a voice that others change at the same moment (`_complete`)

# Letters and digits of any script (the official saved speakers are named like "中文女"), _ . -: nothing that a
# URL path, a Redis key or a log line would have to escape beyond UTF-8.
VOICE_ID_PATTERN = re.compile(r"[\w.-]{1,64}")
# Generated ids look like this; an explicit id of this form could later collide with a generated one.
GENERATED_ID_PATTERN = re.compile(r"v_[0-9a-f]{16}")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")


class CorruptVoice(CosyVoiceError):
    """A stored voice cannot be decoded (damaged blob or unknown format). Maps to INTERNAL / HTTP 500;
    the voice stays stored so that an operator can inspect it, delete it and register it again."""

    def __init__(self, voice_id: str, problem: str):
        self.voice_id = voice_id
        self.problem = problem
        super().__init__(f"voice {voice_id!r} is corrupt in the voice store: {problem}")


@dataclass(frozen=True)
class VoiceRecord:
    """What a voice is, without its arrays."""

    voice_id: str
    text: str  # the prompt transcript
    audio_sha256: str  # `audio_sha256` of the reference recording
    tokens: int  # prompt speech tokens (25 per second of prompt)
    created_at: float  # Unix time of the registration
    name: str | None  # a label for people; not unique
    owner: str | None = None  # the tenant tag of the key that registered it; None: shared
    families: tuple[str, ...] = ()  # the families it holds prompt features for (`StoredVoice.features`)
    has_recording: bool = False  # its recording is kept: another family's features are made from it at first use

    @property
    def shared(self) -> bool:
        return self.owner is None

    @property
    def store_key(self) -> str:
        """Where the store keeps it (`store_key`)."""
        return store_key(self.voice_id, self.owner)

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this voice can serve (zero_shot only with a transcript): `messages.voice_modes`."""
        return voice_modes(self.text)


def store_key(voice_id: str, owner: str | None) -> str:
    """The key a voice is stored under: its id when shared, "owner/id" when owned (ids and owner tags hold no
    "/", so no two voices share one)."""
    return voice_id if owner is None else f"{owner}/{voice_id}"


def lookup_keys(voice_id: str, owner: str | None) -> tuple[str, ...]:
    """The store keys `voice_id` may mean to `owner`, in the order they are tried: its own, then the shared."""
    return (voice_id,) if owner is None else (store_key(voice_id, owner), voice_id)


def visible_to(info: VoiceRecord, owner: str | None) -> bool:
    """A tenant sees its own voices and the shared ones; `owner` None (keyless use) the shared ones."""
    return info.owner is None or info.owner == owner


@dataclass(frozen=True)
class Recording:
    """A voice's prompt recording as it was registered: what another family's features are computed from."""

    samples: np.ndarray  # (N,) float32, mono, at sample_rate
    sample_rate: int


@dataclass(frozen=True)
class StoredVoice:
    """What one blob holds: a voice's transcript, its recording's hash and its features for each family."""

    text: str
    audio_sha256: str
    features: dict[str, PromptFeatures]  # family name -> features (their text and hash are the voice's)

    @classmethod
    def of(cls, features: PromptFeatures, family: str) -> StoredVoice:
        return cls(features.text, features.audio_sha256, {family: features})

    def with_features(self, family: str, features: PromptFeatures) -> StoredVoice:
        return StoredVoice(self.text, self.audio_sha256, {**self.features, family: features})


Encode = Callable[[np.ndarray, int, str, str], PromptFeatures]  # (samples, rate, text, audio_sha256) -> features


@dataclass(frozen=True)
class VoiceStoreStats:
    """Counters of one store instance (they are not shared between processes).

    hits:   gets answered from this instance's LRU (after the revision check with the backing store)
    misses: gets of an id that does not exist (they raise NotFound)
    loads:  gets that read and decoded the voice from the backing store (not in the LRU, or stale)
    size:   voices held decoded in this instance's LRU
    A get that fails with CorruptVoice or a store error counts in none of them.
    """

    hits: int
    misses: int
    loads: int
    size: int


class VoiceStore(Protocol):
    """Voices by (owner, id). `get` and `info` look an id up for `owner` (its own, then the shared ones; None:
    the shared ones only); `list` gives what `owner` sees; `delete` removes the voice of exactly that owner."""

    def register(self, features: PromptFeatures, voice_id: str | None = None, name: str | None = None,
                 owner: str | None = None, *, family: str = FIRST_FAMILY,
                 recording: Recording | None = None) -> VoiceRecord: ...

    def get(self, voice_id: str, owner: str | None = None, family: str = FIRST_FAMILY,
            encode: Encode | None = None) -> PromptFeatures: ...

    def info(self, voice_id: str, owner: str | None = None) -> VoiceRecord: ...

    def find(self, audio_sha256: str, text: str, owner: str | None = None) -> VoiceRecord | None: ...

    def keep_recording(self, info: VoiceRecord, recording: Recording) -> VoiceRecord: ...

    def list(self, owner: str | None = None) -> list[VoiceRecord]: ...

    def delete(self, voice_id: str, owner: str | None = None) -> bool: ...

    def check(self) -> None:
        """Raise (Unavailable for a lost Redis) unless the backing store answers now (readiness)."""

    @property
    def stats(self) -> VoiceStoreStats: ...

    def close(self) -> None: ...


# ---- ids ------------------------------------------------------------------------------------------

def content_key(audio_sha256: str, text: str, owner: str | None = None) -> str:
    """What registration is idempotent by: sha256 of the recording's `audio_sha256` followed by the
    prompt transcript as given (and, for an owned voice, NUL + the owner). Not the audio hash alone: one
    recording with two transcripts is two prompts (see the module docstring). Shared voices keep the key
    they had before owners existed."""
    scoped = "" if owner is None else "\0" + owner
    return hashlib.sha256((audio_sha256 + text + scoped).encode("utf-8")).hexdigest()


def generated_voice_id(audio_sha256: str, text: str, owner: str | None = None) -> str:
    """The id given to a voice registered without one; equal on every server."""
    return "v_" + content_key(audio_sha256, text, owner)[:16]


def short_repr(value: object, limit: int = 48) -> str:
    """`repr(value)` cut to about `limit` characters, for error messages that echo a request's value
    (a 10,000-character id is not echoed whole; repr escapes control characters and surrogates; other
    objects are named by their type, never by a repr with an address)."""
    plain = isinstance(value, (str, bytes, int, float, bool, type(None)))
    text = repr(value) if plain else f"a {type(value).__name__}"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


OWNER_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def owner_tag(key: str) -> str:
    """The owner of voices registered with API key `key` (stable, and not the key): the gateway's tenants and
    `cosyvoice-triton voices import --owner KEY`."""
    return "key_" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


def check_owner(owner: object, field: str = "owner") -> str | None:
    if owner is not None and (not isinstance(owner, str) or not OWNER_PATTERN.fullmatch(owner)):
        raise InvalidInput(field, f"{short_repr(owner)} is not an owner tag (1 to 64 of A-Z a-z 0-9 _ . : -)")
    return owner


def check_voice_id(voice_id: object, field: str = "reference_audio_id") -> str:
    """`voice_id` if it is a well-formed id, else InvalidInput naming `field`."""
    if not isinstance(voice_id, str) or not VOICE_ID_PATTERN.fullmatch(voice_id):
        raise InvalidInput(field, f"{short_repr(voice_id)} is not a voice id (1 to 64 letters, digits, _ . -)")
    return voice_id


def registration_id(features: PromptFeatures, voice_id: str | None, owner: str | None = None) -> str:
    """The id a registration will use: the given one (checked) or the generated one."""
    generated = generated_voice_id(features.audio_sha256, features.text, owner)
    if voice_id is None:
        return generated
    check_voice_id(voice_id, "voice_id")
    if GENERATED_ID_PATTERN.fullmatch(voice_id) and voice_id != generated:
        raise InvalidInput("voice_id", f"{voice_id!r}: ids of the form v_<16 hex digits> are reserved "
                                       "for generated ids")
    return voice_id


def check_name(name: str | None) -> str | None:
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_CHARS):
        raise InvalidInput("name", f"must be a string of at most {MAX_NAME_CHARS} characters")
    return name


@dataclass(frozen=True)
class Registration:
    """One voice ready to be written: what a store kind (SQLite, Redis) stores."""

    info: VoiceRecord
    content_key: str
    revision: str  # random, new on every registration, even of the same id with the same audio
    blob: bytes  # `encode_voice`
    recording: bytes | None  # `encode_recording`; None: none kept (an imported speaker)


def prepare_registration(features: PromptFeatures, voice_id: str | None, name: str | None,
                         owner: str | None = None, family: str = FIRST_FAMILY,
                         recording: Recording | None = None) -> Registration:
    """Check the arguments of `register` and encode the voice (`family`'s features) and its recording."""
    blob = encode_voice(StoredVoice.of(features, check_family_name(family)))  # checks the arrays, text and hash first
    owner = check_owner(owner)
    info = VoiceRecord(voice_id=registration_id(features, voice_id, owner), text=features.text,
                       audio_sha256=features.audio_sha256, tokens=int(features.speech_tokens.shape[0]),
                       created_at=time.time(), name=check_name(name), owner=owner, families=(family,),
                       has_recording=recording is not None)
    return Registration(info=info, content_key=content_key(features.audio_sha256, features.text, owner),
                        revision=secrets.token_hex(8), blob=blob,
                        recording=None if recording is None else encode_recording(recording))


def check_family_name(family: object) -> str:
    if not isinstance(family, str) or not FAMILY_PATTERN.fullmatch(family):
        raise ValueError(f"{short_repr(family)} is not a model family name")
    return family


def families_text(families: tuple[str, ...]) -> str:
    """A voice's families as the stores keep them beside its blob: "cosyvoice2,cosyvoice3" (`split_families`)."""
    return ",".join(families)


def split_families(text: str) -> tuple[str, ...]:
    return tuple(family for family in text.split(",") if family)


def check_same_voice(requested_id: str | None, existing_id: str) -> None:
    """The content is already registered as `existing_id`: registering it again returns that voice,
    unless the caller asked for a different id (which would then not exist)."""
    if requested_id is not None and requested_id != existing_id:
        raise InvalidInput("voice_id", f"this recording and prompt text are already registered as "
                                       f"voice {existing_id!r}")


def id_taken(voice_id: str, owner: str | None, taken_by: VoiceRecord) -> InvalidInput:
    """An id that `owner` cannot register: its own voice of other content, or a shared voice (whose ids every
    tenant sees). Never another owner's voice: that id is free."""
    if taken_by.owner is None and owner is not None:
        return InvalidInput("voice_id", f"{voice_id!r} is the id of a shared voice")
    return InvalidInput("voice_id", f"{voice_id!r} is taken by a different recording or prompt text")


def register_once(store: VoiceStore, audio_sha256: str, text: str, encode: Callable[[], PromptFeatures],
                  voice_id: str | None = None, name: str | None = None, owner: str | None = None, *,
                  family: str = FIRST_FAMILY, recording: Recording | None = None) -> VoiceRecord:
    """Register the recording with hash `audio_sha256` and transcript `text`, computing its prompt
    features (`encode()`, the expensive part, `family`'s) only when the store does not hold that content yet: a
    repeat registration costs a lookup (another family's features of a stored voice are made at its first
    get; a stored voice without a recording keeps `recording`: `keep_recording`). Returns and raises what
    `store.register(encode(), voice_id, name, owner, family=family, recording=recording)` would (two racing first
    registrations both encode; the store keeps one voice)."""
    if voice_id is not None:
        check_voice_id(voice_id, "voice_id")
    check_name(name)
    check_owner(owner)
    found = store.find(audio_sha256, text, owner)
    if found is not None:
        check_same_voice(voice_id, found.voice_id)
        return found if recording is None else store.keep_recording(found, recording)
    return store.register(encode(), voice_id=voice_id, name=name, owner=owner, family=family, recording=recording)


# ---- blob format ----------------------------------------------------------------------------------
# MAGIC, version (u16), header length (u32), CRC-32 of everything after the prefix (u32), all little
# endian; then a UTF-8 JSON header {"text", "audio_sha256", "arrays": [[name, dtype, shape], ...]};
# then the raw little-endian bytes of each array in header order. Version 2 names each family's arrays
# "<family>/embedding", "<family>/speech_tokens", "<family>/mel"; version 1 (one family, CosyVoice2's) had
# "embedding", "speech_tokens", "mel". A recording is a blob of its own (RECORDING_MAGIC, version 1, header
# {"sample_rate"}, one array "samples").

MAGIC = b"CVVS"
RECORDING_MAGIC = b"CVRC"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<4sHII")
_ARRAYS = (("embedding", "<f4"), ("speech_tokens", "<i4"), ("mel", "<f4"))
_SAMPLES = ("samples", "<f4")


def encode_voice(voice: StoredVoice) -> bytes:
    """`voice` as one blob. ValueError if its arrays do not have the documented dtypes and shapes."""
    arrays = []
    for family, features in voice.features.items():
        problem = _shape_problem(features.embedding, features.speech_tokens, features.mel)
        if problem:
            raise ValueError(f"cannot store these prompt features: {problem}")
        arrays += [(f"{check_family_name(family)}/{name}", dtype, getattr(features, name)) for name, dtype in _ARRAYS]
    if not isinstance(voice.text, str) or not SHA256_PATTERN.fullmatch(str(voice.audio_sha256)):
        raise ValueError("cannot store these prompt features: text must be a str and audio_sha256 "
                         "64 lowercase hex digits")
    return _pack(MAGIC, FORMAT_VERSION, {"text": voice.text, "audio_sha256": voice.audio_sha256}, arrays)


def decode_voice(blob: bytes, voice_id: str) -> StoredVoice:
    """The voice in `blob`, with read-only arrays (they may be shared by many requests through the LRU).
    CorruptVoice, naming `voice_id`, for anything that is not a well-formed version 1 or 2 blob."""
    try:
        version, header, arrays = _unpack(memoryview(blob), MAGIC, (1, FORMAT_VERSION))
        return _voice(version, header, arrays)
    except (ValueError, TypeError, KeyError, OverflowError, struct.error) as exc:  # JSON, UTF-8, numpy too
        raise CorruptVoice(voice_id, str(exc)) from exc


def encode_recording(recording: Recording) -> bytes:
    samples = np.asarray(recording.samples)
    if samples.dtype != np.float32 or samples.ndim != 1 or int(recording.sample_rate) <= 0:
        raise ValueError("a recording is (N,) float32 samples at a positive sample rate")
    return _pack(RECORDING_MAGIC, 1, {"sample_rate": int(recording.sample_rate)}, [(*_SAMPLES, samples)])


def decode_recording(blob: bytes, voice_id: str) -> Recording:
    try:
        _, header, arrays = _unpack(memoryview(blob), RECORDING_MAGIC, (1,))
        if [(name, dtype) for name, dtype, _ in arrays] != [_SAMPLES] or arrays[0][2].ndim != 1:
            raise ValueError(f"unexpected arrays {[name for name, _, _ in arrays]}")
        return Recording(samples=arrays[0][2], sample_rate=int(header["sample_rate"]))
    except (ValueError, TypeError, KeyError, OverflowError, struct.error) as exc:
        raise CorruptVoice(voice_id, f"its recording: {exc}") from exc


def _pack(magic: bytes, version: int, header: dict, arrays: list[tuple[str, str, np.ndarray]]) -> bytes:
    arrays = [(name, dtype, np.ascontiguousarray(array)) for name, dtype, array in arrays]
    header = json.dumps({**header, "arrays": [[name, dtype, list(array.shape)] for name, dtype, array in arrays]},
                        ensure_ascii=False).encode("utf-8")
    body = header + b"".join(array.astype(dtype, copy=False).tobytes() for _, dtype, array in arrays)
    return _PREFIX.pack(magic, version, len(header), zlib.crc32(body)) + body


def _unpack(blob: memoryview, magic: bytes, versions: tuple[int, ...]
            ) -> tuple[int, dict, list[tuple[str, str, np.ndarray]]]:
    """(version, header, [(name, dtype, read-only array)]) of a blob of `magic` in one of `versions`."""
    if len(blob) < _PREFIX.size:
        raise ValueError(f"{len(blob)} bytes is shorter than the blob prefix")
    found, version, header_len, crc = _PREFIX.unpack_from(blob)
    if found != magic or version not in versions:
        raise ValueError(f"unknown format {bytes(found)!r} version {version} (expected {magic!r} "
                         f"version {' or '.join(map(str, versions))})")
    body = blob[_PREFIX.size:]
    if zlib.crc32(body) != crc:
        raise ValueError("checksum mismatch")
    header = json.loads(bytes(body[:header_len]).decode("utf-8"))
    offset, arrays = header_len, []
    for name, dtype, shape in header["arrays"]:
        if dtype not in ("<f4", "<i4") or not all(isinstance(size, int) and size >= 0 for size in shape):
            raise ValueError(f"{name}: bad dtype {dtype} or shape {shape}")
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append((name, dtype, np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)))
        offset += count * np.dtype(dtype).itemsize
    if offset != len(body):
        raise ValueError(f"{len(body) - offset} bytes after the last array")
    return version, header, arrays


def _voice(version: int, header: dict, arrays: list[tuple[str, str, np.ndarray]]) -> StoredVoice:
    """The voice of a decoded blob: version 1's three arrays are CosyVoice2's (FIRST_FAMILY)."""
    text, sha = header["text"], header["audio_sha256"]
    if not isinstance(text, str) or not isinstance(sha, str):
        raise ValueError("text and audio_sha256 must be strings")
    names = [name for name, _, _ in arrays]
    if version == 1:
        names = [f"{FIRST_FAMILY}/{name}" for name in names]
    families = list(dict.fromkeys(name.split("/", 1)[0] for name in names))
    expected = [(f"{family}/{name}", dtype) for family in families for name, dtype in _ARRAYS]
    if not families or [(name, dtype) for name, (_, dtype, _) in zip(names, arrays)] != expected:
        raise ValueError(f"unexpected arrays {[name for name, _, _ in arrays]}")
    features = {}
    for at, family in enumerate(families):
        embedding, tokens, mel = (array for _, _, array in arrays[3 * at:3 * at + 3])
        problem = _shape_problem(embedding, tokens, mel)
        if problem:
            raise ValueError(f"{family}: {problem}")
        features[family] = PromptFeatures(embedding=embedding, speech_tokens=tokens, mel=mel, text=text,
                                          audio_sha256=sha)
    return StoredVoice(text, sha, features)


def _shape_problem(embedding: np.ndarray, tokens: np.ndarray, mel: np.ndarray) -> str | None:
    """What is wrong with the arrays of a voice, or None."""
    if not (isinstance(embedding, np.ndarray) and embedding.dtype == np.float32
            and embedding.shape == (EMBEDDING_DIM,)):
        return f"embedding must be ({EMBEDDING_DIM},) float32"
    if not (isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1
            and tokens.shape[0] > 0):
        return "speech_tokens must be (N,) int32 with N > 0"
    expected_mel = (TOKEN_MEL_RATIO * tokens.shape[0], MEL_BINS)
    if not (isinstance(mel, np.ndarray) and mel.dtype == np.float32 and mel.shape == expected_mel):
        return f"mel must be {expected_mel} float32 for {tokens.shape[0]} speech tokens"
    return None


# ---- the LRU in front of every store kind ---------------------------------------------------------

class CachedVoiceStore(ABC):
    """`get` through a thread-safe LRU of decoded voices (by store key), each kept with the revision it was read
    at, and the lookup of an id for an owner (`lookup_keys`). A store kind supplies the reads and writes by store
    key below and `register`, `find`, `list`, `check` and `close`."""

    def __init__(self, lru_size: int):
        if lru_size < 0:
            raise ValueError(f"lru_size must be >= 0, got {lru_size}")
        self._lru_size = lru_size
        self._lru: OrderedDict[str, tuple[str, StoredVoice]] = OrderedDict()
        self._lock = threading.Lock()  # guards the LRU and the counters
        self._hits = self._misses = self._loads = 0

    @abstractmethod
    def _revision(self, key: str) -> str | None:
        """The stored revision of the voice at store key `key`, None if there is none. Must be cheap."""

    @abstractmethod
    def _read(self, key: str) -> tuple[str, bytes] | None:
        """(revision, blob) of the voice at `key` read together, None if there is none."""

    @abstractmethod
    def _read_recording(self, key: str) -> bytes | None:
        """The recording blob of the voice at `key`, None if it has none kept (or there is no such voice)."""

    @abstractmethod
    def _replace(self, key: str, expected: str, revision: str, blob: bytes, families: tuple[str, ...]) -> bool:
        """Write `blob` (holding `families`' features) under a new `revision` for the voice at `key`, atomically and
        only while its revision is still `expected`; False (nothing written) otherwise."""

    @abstractmethod
    def _keep_recording(self, key: str, recording: bytes) -> bool:
        """Keep `recording` (`encode_recording`) with the voice at `key` if it is there and has none kept;
        False (nothing written) otherwise."""

    @abstractmethod
    def _info(self, key: str) -> VoiceRecord | None:
        """The record of the voice at `key`, None if there is none."""

    @abstractmethod
    def _delete(self, key: str) -> bool:
        """Remove the voice at `key`; False if there was none."""

    @abstractmethod
    def find(self, audio_sha256: str, text: str, owner: str | None = None) -> VoiceRecord | None:
        """The voice `owner` registered for this recording and transcript (its content key), whatever its
        id; None if there is none."""

    def info(self, voice_id: str, owner: str | None = None) -> VoiceRecord:
        """What `voice_id` is to `owner` (its own, else a shared one); NotFound("reference_audio_id") if neither."""
        check_voice_id(voice_id)
        for key in lookup_keys(voice_id, check_owner(owner)):
            info = self._info(key)
            if info is not None:
                return info
        raise NotFound("reference_audio_id", f"no voice {voice_id!r} is registered")

    def get(self, voice_id: str, owner: str | None = None, family: str = FIRST_FAMILY,
            encode: Encode | None = None) -> PromptFeatures:
        """The `family` features of `voice_id` to `owner` (its own, else a shared one); NotFound("reference_audio_id")
        if neither. A voice without features for `family` yet gets them now from its recording (`_complete`)."""
        check_voice_id(voice_id)
        for key in lookup_keys(voice_id, check_owner(owner)):
            voice = self._get(key, voice_id)
            if voice is not None:
                features = voice.features.get(family)
                return features if features is not None else self._complete(key, voice_id, voice, family, encode)
        with self._lock:
            self._misses += 1
        raise NotFound("reference_audio_id", f"no voice {voice_id!r} is registered")

    def delete(self, voice_id: str, owner: str | None = None) -> bool:
        """Remove `owner`'s voice `voice_id` (None: the shared one); False if there was none. Other instances
        see it at their next get."""
        check_voice_id(voice_id)
        key = store_key(voice_id, check_owner(owner))
        deleted = self._delete(key)
        self._forget(key)
        return deleted

    def keep_recording(self, info: VoiceRecord, recording: Recording) -> VoiceRecord:
        """Keep `recording` with `info`'s voice when it has none (stored before voices kept one): registering the
        recording again (`register_once`, `register`) lets every other family's features be made from it, and the
        voice keeps its id and features. ValueError unless `recording` is the one the voice's audio_sha256 hashes.
        Returns the voice as stored now."""
        if info.has_recording:
            return info
        if audio_sha256(recording.samples, recording.sample_rate) != info.audio_sha256:
            raise ValueError(f"voice {info.voice_id!r} was registered from another recording")
        self._keep_recording(info.store_key, encode_recording(recording))
        return self._info(info.store_key) or info  # (deleted meanwhile: as it was)

    def _blob_families(self, key: str, voice_id: str) -> tuple[str, ...]:
        """The families the blob of the voice at `key` holds features for: for a voice stored before the stores kept
        them beside it (() for a corrupt blob: `get` reports it)."""
        stored = self._read(key)
        try:
            return () if stored is None else tuple(decode_voice(stored[1], voice_id).features)
        except CorruptVoice:
            return ()

    @property
    def stats(self) -> VoiceStoreStats:
        with self._lock:
            return VoiceStoreStats(hits=self._hits, misses=self._misses, loads=self._loads,
                                   size=len(self._lru))

    def _get(self, key: str, voice_id: str) -> StoredVoice | None:
        """The voice at store key `key` (from the LRU while its revision holds), None if there is none."""
        with self._lock:
            cached = self._lru.get(key)
        if cached is not None and self._revision(key) == cached[0]:
            with self._lock:
                self._hits += 1
                if key in self._lru:
                    self._lru.move_to_end(key)
            return cached[1]
        stored = self._read(key)
        if stored is None:
            self._forget(key)  # deleted elsewhere: drop the stale copy
            return None
        revision, blob = stored
        voice = decode_voice(blob, voice_id)
        with self._lock:
            self._loads += 1
        self._remember(key, revision, voice)
        return voice

    def _complete(self, key: str, voice_id: str, voice: StoredVoice, family: str,
                  encode: Encode | None) -> PromptFeatures:
        """`family`'s features of the voice at `key`, which has none: `encode` computes them from its recording,
        outside any lock (two instances may both compute them: they are equal), and they are written beside
        the others unless the voice changed in between, when it is read again (it may hold them now)."""
        recording = self._read_recording(key)
        if recording is None:
            raise InvalidInput("reference_audio_id", f"voice {voice_id!r} has {' and '.join(voice.features)} features "
                                                     f"only and no recording to make {family}'s from (stored before "
                                                     "voices kept one, or imported): register its recording again "
                                                     "with the same transcript; the voice keeps its id and features "
                                                     "and gains the recording")
        if encode is None:
            raise InvalidInput("reference_audio_id", f"voice {voice_id!r} has no {family} features yet (a server of "
                                                     "that family makes them at the voice's first use)")
        recording = decode_recording(recording, voice_id)
        features = encode(recording.samples, recording.sample_rate, voice.text, voice.audio_sha256)
        for _ in range(COMPLETE_TRIES):
            current = self._read(key)
            if current is None:
                raise NotFound("reference_audio_id", f"no voice {voice_id!r} is registered")  # deleted meanwhile
            revision, blob = current
            voice = decode_voice(blob, voice_id)
            if family not in voice.features:
                voice, expected, revision = voice.with_features(family, features), revision, secrets.token_hex(8)
                blob = encode_voice(voice)
                if not self._replace(key, expected, revision, blob, tuple(voice.features)):
                    continue
                voice = decode_voice(blob, voice_id)
            self._remember(key, revision, voice)
            return voice.features[family]
        return features  # changed at every try: served as computed, kept by a later get

    def _remember(self, key: str, revision: str, voice: StoredVoice) -> None:
        if self._lru_size == 0:
            return
        with self._lock:
            self._lru[key] = (revision, voice)
            self._lru.move_to_end(key)
            while len(self._lru) > self._lru_size:
                self._lru.popitem(last=False)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._lru.pop(key, None)
