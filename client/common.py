"""What the Triton and gateway clients share: the error type, voice records, prompt audio and WAV files.

Everything here needs only numpy and the standard library.
"""
from __future__ import annotations

import io
import os
import re
import struct
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 24000  # CosyVoice2 speaks at 24 kHz, mono

# A prompt recording: a file (path or its bytes: WAV, FLAC, OGG, ...) or samples in [-1, 1].
PromptAudio = str | os.PathLike | bytes | np.ndarray

_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*):\s")


class TTSError(Exception):
    """The server refused or failed a request.

    `message` is the server's text ("text: must not be empty"), `field` the request field at fault when
    the server named one ("text", "voice_id", "target_text", ...), `status` an HTTP status or a gRPC code
    name ("INVALID_ARGUMENT", "UNAVAILABLE", ...), `code` the gateway's short reason ("invalid_input",
    "not_found", "too_many_streams", ...).
    """

    def __init__(self, message: str, *, field: str | None = None, status: int | str | None = None,
                 code: str | None = None):
        self.message = message
        self.field = field
        self.status = status
        self.code = code
        super().__init__(message if not field or message.startswith(f"{field}:") else f"{field}: {message}")

    @classmethod
    def from_message(cls, text: str, status: int | str | None = None) -> TTSError:
        """A Triton error text; by this project's convention "field: problem" names the field."""
        text = (text or "unknown error").strip()
        match = _FIELD.match(text)
        return cls(text, field=match.group(1) if match else None, status=status)

    @classmethod
    def from_body(cls, body: object, status: int | None = None) -> TTSError:
        """A gateway error: {"error": {"message", "code", "param", "type"}} over HTTP, or
        {"type": "error", "message", "code", "param", "status"} over the WebSocket."""
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(body, dict) and body.get("type") == "error":
            error = body
        if isinstance(error, str):
            error = {"message": error}
        if not isinstance(error, dict):
            return cls(f"HTTP {status}: {str(body)[:300]}", status=status)
        return cls(str(error.get("message") or f"HTTP {status}"), field=error.get("param") or error.get("field"),
                   status=error.get("status", status), code=error.get("code"))


@dataclass(frozen=True)
class VoiceInfo:
    """A registered voice."""

    voice_id: str
    audio_sha256: str | None = None
    prompt_tokens: int | None = None  # prompt speech tokens stored (25 per second of prompt)
    prompt_text: str | None = None
    name: str | None = None
    extra: dict | None = None  # whatever else the server told about it

    @property
    def prompt_seconds(self) -> float | None:
        return None if self.prompt_tokens is None else self.prompt_tokens / 25.0


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
        raise ValueError(f"prompt audio must be (N,) or (N, channels) samples, got shape {array.shape}")
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
        raise ValueError("not a WAV file")
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
        raise ValueError("WAV file without fmt or data chunk")
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
        raise ValueError(f"unsupported WAV encoding (format {kind}, {bits} bits)")
    if channels > 1:
        samples = samples[: len(samples) // channels * channels].reshape(-1, channels).mean(axis=1)
    return np.ascontiguousarray(samples, dtype=np.float32), rate


def _is_float_extensible(raw: bytes) -> bool:
    at = raw.find(b"fmt ")
    return at >= 0 and struct.unpack("<H", raw[at + 8 + 24:at + 8 + 26])[0] == 3

