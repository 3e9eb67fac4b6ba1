"""The blocking gateway client's audio streams and what they share with the asyncio client (gateway_aio.py):
the float32 PCM decoder, the stream's info, the error body and the WebSocket and server-sent event handlers.
Speech marks (docs/api/speech-marks.md) come as WebSocket messages or server-sent events among the audio; each
chunk takes the events that came before it (`MarkCollector`)."""
from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from cosyvoice_triton.pipeline.speech_marks import MarkList, event_of

from .common import SAMPLE_RATE, TTSError, with_marks

_READ = 64 * 1024


class PcmDecoder:
    """Bytes of little-endian float32 in arbitrary pieces -> whole samples."""

    def __init__(self):
        self.rest = b""

    def feed(self, data: bytes) -> np.ndarray:
        data = self.rest + data
        cut = len(data) // 4 * 4
        self.rest = data[cut:]
        return np.frombuffer(data[:cut], "<f4").astype(np.float32)


@dataclass
class MarkCollector:
    """A stream's speech mark events as they arrive: each chunk takes those that came before it (`attach`, when
    the request asked for marks: `wanted`); `marks` are the complete marks."""

    wanted: bool = False
    pending: list[dict] = field(default_factory=list)
    complete: MarkList = field(default_factory=MarkList)

    def add(self, event: dict) -> None:
        self.pending.append(event)
        self.complete.add(event)

    def attach(self, chunk: np.ndarray) -> np.ndarray:
        if not self.wanted:
            return chunk
        chunk, self.pending = with_marks(chunk, self.pending), []
        return chunk

    @property
    def marks(self) -> list[dict]:
        return self.complete.marks


@dataclass
class StreamInfo:
    """What the gateway said about a stream: headers (HTTP) or its messages (WebSocket)."""

    request_id: str | None = None
    seed: int | None = None
    sample_rate: int = SAMPLE_RATE
    first_chunk_s: float | None = None  # measured here: request sent -> first audio bytes
    samples: int = 0
    segments: list[dict] = field(default_factory=list)  # WebSocket "segment" messages
    end: dict | None = None  # WebSocket "end" message: segments, audio_seconds, first_chunk_ms, elapsed_ms
    speech_marks: MarkCollector = field(default_factory=MarkCollector)

    @property
    def marks(self) -> list[dict]:
        """The stream's complete speech marks (a request with marks=True)."""
        return self.speech_marks.marks

    @property
    def audio_seconds(self) -> float:
        return self.samples / self.sample_rate

    def _add(self, chunk: np.ndarray, started: float) -> None:
        if chunk.size and self.first_chunk_s is None:
            self.first_chunk_s = time.monotonic() - started
        self.samples += chunk.size


def error_from_body(data: bytes, status: int, retry_after: str | None = None) -> TTSError:
    """The gateway's error answer (JSON, or plain text from something in front of it; `retry_after`: its
    Retry-After header) as a TTSError."""
    try:
        body = json.loads(data)
    except ValueError:
        body = data.decode("utf-8", "replace")
    return TTSError.from_body(body, status, retry_after)


def ws_message(stats: StreamInfo, decoder: PcmDecoder, message: bytes | dict,
               started: float) -> tuple[np.ndarray | None, bool]:
    """One WebSocket message of a stream: (its audio, or None; whether it is the end message). Segment and
    end messages go into `stats`."""
    if isinstance(message, bytes):
        chunk = decoder.feed(message)
        if chunk.size:
            stats._add(chunk, started)
            return stats.speech_marks.attach(chunk), False
    elif (event := event_of(message)) is not None:
        stats.speech_marks.add(event)
    elif message.get("type") == "segment":
        stats.segments.append(message)
    elif message.get("type") == "end":
        stats.end = message
        return None, True
    return None, False


def sse_message(stats: StreamInfo, decoder: PcmDecoder, line: bytes, started: float) -> tuple[np.ndarray | None, bool]:
    """One line of a server-sent event stream (/v1/tts streamed with marks, the OpenAI route's sse) as
    `ws_message` reads a WebSocket message: an audio delta's chunk, a mark event, the done event, an error."""
    if not line.startswith(b"data:"):
        return None, False
    data = json.loads(line[5:])
    kind = data.get("type")
    if kind == "speech.audio.delta":
        chunk = decoder.feed(base64.b64decode(data["audio"]))
        if chunk.size:
            stats._add(chunk, started)
            return stats.speech_marks.attach(chunk), False
    elif (event := event_of(data, "speech.")) is not None:
        stats.speech_marks.add(event)
    elif kind == "speech.audio.done":
        stats.end = data
        return None, True
    elif kind == "error":
        raise TTSError.from_body(data, 502)
    return None, False


class HttpAudioStream(Iterator[np.ndarray]):
    """Float32 chunks of a streamed /v1/tts answer, as the gateway sent them, when they arrive. `close()` cancels."""

    def __init__(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse, started: float):
        self._connection = connection
        self._response = response
        self._decoder = PcmDecoder()
        self._started = started
        self._done = False
        seed = response.getheader("X-Seed")
        self.stats = StreamInfo(request_id=response.getheader("X-Request-Id"), seed=int(seed) if seed else None,
                                sample_rate=int(response.getheader("X-Sample-Rate") or SAMPLE_RATE))

    def __iter__(self) -> HttpAudioStream:
        return self

    def __next__(self) -> np.ndarray:
        while not self._done:
            try:
                data = self._read_http_chunk()
            except (http.client.IncompleteRead, OSError) as exc:
                self.close()
                raise TTSError(f"the stream was cut before its end ({type(exc).__name__})", status=502) from None
            if not data:
                self.close()
                break
            chunk = self._decoder.feed(data)
            if chunk.size:
                self.stats._add(chunk, self._started)
                return chunk
        raise StopIteration

    def _read_http_chunk(self) -> bytes:
        """One chunk of the chunked body, whole: the gateway writes each audio chunk as one (routes_tts),
        so these are the service's chunks, not the network's reads. `chunked`/`chunk_left` are
        http.client's framing state (bytes left of the current chunk; 0 at its end, None after the last)."""
        parts = [self._response.read1(_READ)]
        while parts[-1] and self._response.chunked and self._response.chunk_left:
            parts.append(self._response.read1(self._response.chunk_left))
        return b"".join(parts)

    def close(self) -> None:
        self._done = True
        self._connection.close()

    def __enter__(self) -> HttpAudioStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HttpEventStream(HttpAudioStream):
    """Float32 chunks of a streamed /v1/tts answer with marks: server-sent events, each chunk's `marks` the
    events before it, `marks` the complete ones."""

    def __init__(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse, started: float):
        super().__init__(connection, response, started)
        self.stats.speech_marks.wanted = True

    @property
    def marks(self) -> list[dict]:
        return self.stats.marks

    def __next__(self) -> np.ndarray:
        while not self._done:
            try:
                line = self._response.readline()
            except (http.client.IncompleteRead, OSError) as exc:
                self.close()
                raise TTSError(f"the stream was cut before its end ({type(exc).__name__})", status=502) from None
            if not line:
                self.close()
                raise TTSError("the stream ended before its speech.audio.done event", status=502)
            chunk, ended = sse_message(self.stats, self._decoder, line, self._started)
            if ended:
                self.close()
            elif chunk is not None:
                return chunk
        raise StopIteration


class WsAudioStream(Iterator[np.ndarray]):
    """A WebSocket session (/v1/tts/ws): float32 chunks as they come; text can be added while it runs
    (`send_text`, `flush`, `end`). `stats.end` holds the server's end message once iteration is over.
    `close()` before the end cancels the synthesis."""

    def __init__(self, ws, started: float, texts: Iterable[str] | None):
        self._ws = ws
        self._decoder = PcmDecoder()
        self._started = started
        self._done = False
        self._lock = threading.Lock()
        self.stats = StreamInfo()
        started_message = self._receive_json()
        self.stats.request_id = started_message.get("request_id")
        self.stats.seed = started_message.get("seed")
        self.stats.sample_rate = started_message.get("sample_rate", SAMPLE_RATE)
        self._sender = None
        if texts is not None:
            self._sender = threading.Thread(target=self._send_all, args=(texts,), daemon=True)
            self._sender.start()

    def _send_all(self, texts: Iterable[str]) -> None:
        try:
            for text in texts:
                if self._done:
                    return
                self.send_text(text)
            self.end()
        except Exception:  # noqa: BLE001 - the session ended (its error reaches the reader)
            pass

    def _send(self, message: dict) -> None:
        with self._lock:
            self._ws.send(json.dumps(message))

    def send_text(self, text: str) -> None:
        self._send({"type": "text", "text": text})

    def flush(self) -> None:
        self._send({"type": "flush"})

    def end(self) -> None:
        self._send({"type": "end"})

    def _receive_json(self) -> dict:
        message = self._receive()
        if isinstance(message, bytes):
            raise TTSError("expected a JSON message, got audio", status=502)
        return message

    def _receive(self) -> dict | bytes:
        from websockets.exceptions import ConnectionClosed

        try:
            message = self._ws.recv()
        except ConnectionClosed as exc:
            self._done = True
            raise TTSError(f"the gateway closed the WebSocket ({exc})", status=502) from None
        if isinstance(message, bytes):
            return message
        data = json.loads(message)
        if data.get("type") == "error":
            self.close()
            raise TTSError.from_body(data)
        return data

    def __iter__(self) -> WsAudioStream:
        return self

    @property
    def marks(self) -> list[dict]:
        """The complete speech marks received so far (a session started with marks=True)."""
        return self.stats.marks

    def __next__(self) -> np.ndarray:
        while not self._done:
            chunk, ended = ws_message(self.stats, self._decoder, self._receive(), self._started)
            if ended:
                self.close()
            elif chunk is not None:
                return chunk
        raise StopIteration

    def close(self) -> None:
        self._done = True
        self._ws.close()

    def __enter__(self) -> WsAudioStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
