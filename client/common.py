"""What the Triton and gateway clients share: the error type, voice records, prompt audio and WAV files.

Everything here needs only numpy, the standard library and the library's light base modules: `errors` (a
Triton error is read with `errors.from_wire`, the one reader of the error JSON our models send) and
`messages` (SAMPLE_RATE).
"""
from __future__ import annotations

import io
import os
import struct
import time
import wave
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path

import numpy as np

from cosyvoice_triton.errors import CosyVoiceError, InvalidInput
from cosyvoice_triton.messages import SAMPLE_RATE, SPEECH_TOKENS_PER_SECOND

# A prompt recording: a file (path or its bytes: WAV, FLAC, OGG, ...) or samples in [-1, 1].
PromptAudio = str | os.PathLike | bytes | np.ndarray


class MarkedAudio(np.ndarray):
    """Float32 audio (a numpy array, as every chunk) that carries speech marks (docs/api/speech-marks.md): a
    streamed chunk's `marks` are the mark events that came with it (before its audio: a sentence's mark with
    end_ms null, a mark_end ending an earlier one); a whole answer's are the complete marks. Given only when a
    request asks for marks; arrays made from one (slices, sums) carry none."""

    marks: list[dict]

    def __array_finalize__(self, obj) -> None:
        self.marks = []


def with_marks(audio: np.ndarray, marks: list[dict]) -> MarkedAudio:
    marked = np.asarray(audio, dtype=np.float32).view(MarkedAudio)
    marked.marks = marks
    return marked


class TTSError(CosyVoiceError):
    """The server refused or failed a request: one of the library's errors (cosyvoice_triton/errors.py), as the
    server said it.

    `message` is the server's text ("text: must not be empty"), `field` the request field at fault when
    the server named one ("text", "voice_id", "target_text", ...), `status` an HTTP status or a gRPC code
    name ("INVALID_ARGUMENT", "UNAVAILABLE", ...), `code` the error's code ("invalid_input", "not_found",
    "too_many_streams", ...: errors.py lists them), `retry_after_s` the seconds the server asked the client to
    wait before trying again when it refused under overload or a limit (the gateway's `Retry-After` header or
    WebSocket `retry_after`, the `retry_after_s` of Triton's error), else None.
    """

    def __init__(self, message: str, *, field: str | None = None, status: int | str | None = None,
                 code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message if not field or message.startswith(f"{field}:") else f"{field}: {message}",
                         field=field)
        self._message = message
        self.status = status
        self.code = code
        self.retry_after_s = retry_after_s  # as the server said it (seconds, maybe a fraction)

    @property
    def message(self) -> str:
        return self._message

    @classmethod
    def from_error(cls, error: CosyVoiceError, status: int | str | None = None) -> TTSError:
        """A Triton error, as `errors.from_wire` read it (`status`: the call's gRPC status name, if any)."""
        return cls(error.message, field=error.field, status=status, code=error.code,
                   retry_after_s=error.retry_after_s)

    @classmethod
    def from_body(cls, body: object, status: int | None = None, retry_after: str | None = None) -> TTSError:
        """A gateway error: {"error": {"message", "code", "param", "type"}} over HTTP (`retry_after`: the
        answer's Retry-After header), or {"type": "error", "message", "code", "param", "status",
        "retry_after"} over the WebSocket."""
        retry_after_s = retry_after_seconds(retry_after)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(body, dict) and body.get("type") == "error":
            error = body
            retry_after_s = retry_after_seconds(body.get("retry_after"))
        if isinstance(error, str):
            error = {"message": error}
        if not isinstance(error, dict):
            return cls(f"HTTP {status}: {str(body)[:300]}", status=status, retry_after_s=retry_after_s)
        return cls(str(error.get("message") or f"HTTP {status}"), field=error.get("param") or error.get("field"),
                   status=error.get("status", status), code=error.get("code"), retry_after_s=retry_after_s)


def retry_after_seconds(value: str | float | None) -> float | None:
    """A Retry-After value in seconds: delta-seconds ("2"), or an HTTP date (seconds from now, at least 0);
    None when absent or unreadable."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return max(0.0, float(value))
    text = str(value).strip()
    if text.isdigit():
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None  # an HTTP date is always GMT; a date without a zone is not one
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class VoiceInfo:
    """A registered voice."""

    voice_id: str
    audio_sha256: str | None = None
    prompt_tokens: int | None = None  # prompt speech tokens stored (25 per second of prompt)
    prompt_text: str | None = None
    name: str | None = None
    modes: tuple[str, ...] | None = None  # what it can serve: zero_shot only with a transcript (None: not said)
    extra: dict | None = None  # whatever else the server told about it

    @property
    def prompt_seconds(self) -> float | None:
        return None if self.prompt_tokens is None else self.prompt_tokens / SPEECH_TOKENS_PER_SECOND


def source_recording(source_audio: PromptAudio | None, audio: PromptAudio | None) -> PromptAudio:
    """The recording a voice conversion speaks again: `source_audio`, or `audio`, the name it had before."""
    if source_audio is not None and audio is not None:
        raise InvalidInput("source_audio", "give source_audio (or its alias audio), not both")
    if source_audio is None and audio is None:
        raise InvalidInput("source_audio", "is required: the recording to convert")
    return audio if source_audio is None else source_audio


def prompt_bytes(audio: str | os.PathLike | bytes) -> bytes:
    """The bytes of a prompt file given as a path or as bytes."""
    if isinstance(audio, (bytes, bytearray, memoryview)):
        return bytes(audio)
    return Path(audio).read_bytes()


def as_samples(audio: np.ndarray) -> np.ndarray:
    """Mono float32 samples, (N,); int16 PCM is scaled to [-1, 1], (N, C) is averaged over channels."""
    array = np.asarray(audio)
    if array.dtype == np.int16:
        array = array.astype(np.float32) / 32768.0
    array = array.astype(np.float32, copy=False)
    if array.ndim == 2:
        array = array.mean(axis=1 if array.shape[1] <= 8 else 0)
    if array.ndim != 1:
        raise InvalidInput("prompt_audio", f"must be (N,) or (N, channels) samples, got shape {array.shape}")
    return np.ascontiguousarray(array)


# ---- WAV files ---------------------------------------------------------------------------------------

def wav_bytes(audio: np.ndarray, sample_rate: int = SAMPLE_RATE, *, float32: bool = False) -> bytes:
    """A mono WAV file: 16-bit PCM (default) or 32-bit IEEE float."""
    samples = np.asarray(audio, dtype=np.float32).reshape(-1)
    if float32:
        data = samples.astype("<f4").tobytes()
        fmt = struct.pack("<HHIIHH", 3, 1, sample_rate, sample_rate * 4, 4, 32)
        body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
        return b"RIFF" + struct.pack("<I", len(body)) + body
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def write_wav(path: str | os.PathLike, audio: np.ndarray, sample_rate: int = SAMPLE_RATE, *,
              float32: bool = False) -> Path:
    path = Path(path)
    path.write_bytes(wav_bytes(audio, sample_rate, float32=float32))
    return path


def read_wav(data: bytes | str | os.PathLike) -> tuple[np.ndarray, int]:
    """(float32 mono samples, rate) of a PCM-16/24/32 or IEEE-float WAV file."""
    raw = prompt_bytes(data)
    if raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise InvalidInput("audio", "is not a WAV file")
    pos, fmt, payload = 12, None, None
    while pos + 8 <= len(raw):
        tag, size = raw[pos:pos + 4], struct.unpack("<I", raw[pos + 4:pos + 8])[0]
        chunk = raw[pos + 8:pos + 8 + size]
        if tag == b"fmt ":
            fmt = struct.unpack("<HHIIHH", chunk[:16])
        elif tag == b"data":
            payload = chunk
        pos += 8 + size + (size & 1)
    if fmt is None or payload is None:
        raise InvalidInput("audio", "is a WAV file without fmt or data chunk")
    kind, channels, rate, _, _, bits = fmt
    if kind == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: the subformat's first two bytes hold the kind
        kind = 3 if bits == 32 and _is_float_extensible(raw) else 1
    if kind == 3 and bits == 32:
        samples = np.frombuffer(payload[:len(payload) // 4 * 4], "<f4").astype(np.float32)
    elif kind == 1 and bits == 16:
        samples = np.frombuffer(payload[:len(payload) // 2 * 2], "<i2").astype(np.float32) / 32768.0
    elif kind == 1 and bits == 32:
        samples = np.frombuffer(payload[:len(payload) // 4 * 4], "<i4").astype(np.float32) / 2147483648.0
    elif kind == 1 and bits == 24:
        b = np.frombuffer(payload[:len(payload) // 3 * 3], np.uint8).reshape(-1, 3).astype(np.int32)
        value = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8
        samples = value.astype(np.float32) / 8388608.0
    else:
        raise InvalidInput("audio", f"has an unsupported WAV encoding (format {kind}, {bits} bits)")
    if channels > 1:
        samples = samples[: len(samples) // channels * channels].reshape(-1, channels).mean(axis=1)
    return np.ascontiguousarray(samples, dtype=np.float32), rate


def _is_float_extensible(raw: bytes) -> bool:
    at = raw.find(b"fmt ")
    return at >= 0 and struct.unpack("<H", raw[at + 8 + 24:at + 8 + 26])[0] == 3

