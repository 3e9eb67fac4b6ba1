"""The SDK's asyncio client of the gateway (aiohttp): `AsyncGatewayTTS`, with the methods of `GatewayTTS` awaited
(docs/api/sdk.md). `stream()` and `stream_ws()` are awaited once (the request sent, its answer begun) and then
iterated; `aclose()` (or leaving `async with`) before the end cancels the synthesis on the server.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from urllib.parse import quote

import aiohttp
import numpy as np

from .common import SAMPLE_RATE, PromptAudio, TTSError, VoiceInfo, retry_after_seconds
from .gateway_client import DEFAULT_URL, _voice_form, marked_audio, tts_body, vc_form, voice_from_json
from .gateway_streams import PcmDecoder, StreamInfo, error_from_body, sse_message, ws_message


class AsyncHttpAudioStream(AsyncIterator[np.ndarray]):
    def __init__(self, response, started: float):
        self._response = response
        self._decoder = PcmDecoder()
        self._started = started
        seed = response.headers.get("X-Seed")
        self.stats = StreamInfo(request_id=response.headers.get("X-Request-Id"), seed=int(seed) if seed else None,
                                sample_rate=int(response.headers.get("X-Sample-Rate") or SAMPLE_RATE))

    def __aiter__(self) -> AsyncHttpAudioStream:
        return self

    async def __anext__(self) -> np.ndarray:
        while True:
            try:
                data = await self._read_http_chunk()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                await self.aclose()
                raise TTSError(f"the stream was cut before its end ({type(exc).__name__})", status=502) from None
            if not data:
                await self.aclose()
                raise StopAsyncIteration
            chunk = self._decoder.feed(data)
            if chunk.size:
                self.stats._add(chunk, self._started)
                return chunk

    async def _read_http_chunk(self) -> bytes:
        """One chunk of the chunked body, whole (the gateway writes each audio chunk as one): aiohttp's
        readchunk() gives (data, end of an HTTP chunk), and (b"", False) at the end of the body."""
        parts = []
        while True:
            data, chunk_end = await self._response.content.readchunk()
            parts.append(data)
            if chunk_end or not data:
                return b"".join(parts)

    async def aclose(self) -> None:
        self._response.close()

    async def __aenter__(self) -> AsyncHttpAudioStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncHttpEventStream(AsyncHttpAudioStream):
    """A streamed /v1/tts answer with marks (server-sent events), as the blocking `HttpEventStream`."""

    def __init__(self, response, started: float):
        super().__init__(response, started)
        self.stats.speech_marks.wanted = True
        self._done = False
        self._buffer = b""

    @property
    def marks(self) -> list[dict]:
        return self.stats.marks

    async def __anext__(self) -> np.ndarray:
        while not self._done:
            try:
                line = await self._readline()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                await self.aclose()
                raise TTSError(f"the stream was cut before its end ({type(exc).__name__})", status=502) from None
            if not line:
                await self.aclose()
                raise TTSError("the stream ended before its speech.audio.done event", status=502)
            chunk, ended = sse_message(self.stats, self._decoder, line, self._started)
            if ended:
                self._done = True
                await self.aclose()
            elif chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def _readline(self) -> bytes:
        """The next line, however long (an audio delta is one line: aiohttp's readline caps lines at 128 KiB)."""
        while b"\n" not in self._buffer:
            data = await self._response.content.readany()
            if not data:
                line, self._buffer = self._buffer, b""
                return line
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line + b"\n"


class AsyncWsAudioStream(AsyncIterator[np.ndarray]):
    def __init__(self, ws, started: float):
        self._ws = ws
        self._decoder = PcmDecoder()
        self._started = started
        self._done = False
        self._sender: asyncio.Task | None = None
        self.stats = StreamInfo()

    async def _begin(self, texts: Iterable[str] | AsyncIterable[str] | None) -> None:
        started_message = await self._receive()
        if isinstance(started_message, bytes):
            raise TTSError("expected the started message, got audio", status=502)
        self.stats.request_id = started_message.get("request_id")
        self.stats.seed = started_message.get("seed")
        self.stats.sample_rate = started_message.get("sample_rate", SAMPLE_RATE)
        if texts is not None:
            self._sender = asyncio.create_task(self._send_all(texts))

    async def _send_all(self, texts) -> None:
        try:
            if isinstance(texts, AsyncIterable):
                async for text in texts:
                    await self.send_text(text)
            else:
                for text in texts:
                    await self.send_text(text)
            await self.end()
        except Exception:  # noqa: BLE001 - the session ended (its error reaches the reader)
            pass

    async def send_text(self, text: str) -> None:
        await self._ws.send_json({"type": "text", "text": text})

    async def flush(self) -> None:
        await self._ws.send_json({"type": "flush"})

    async def end(self) -> None:
        await self._ws.send_json({"type": "end"})

    async def _receive(self) -> dict | bytes:
        message = await self._ws.receive()
        if message.type == aiohttp.WSMsgType.BINARY:
            return message.data
        if message.type == aiohttp.WSMsgType.TEXT:
            data = json.loads(message.data)
            if data.get("type") == "error":
                await self.aclose()
                raise TTSError.from_body(data)
            return data
        self._done = True
        raise TTSError(f"the gateway closed the WebSocket (code {self._ws.close_code})", status=502)

    def __aiter__(self) -> AsyncWsAudioStream:
        return self

    @property
    def marks(self) -> list[dict]:
        """The complete speech marks received so far (a session started with marks=True)."""
        return self.stats.marks

    async def __anext__(self) -> np.ndarray:
        while not self._done:
            chunk, ended = ws_message(self.stats, self._decoder, await self._receive(), self._started)
            if ended:
                await self.aclose()
            elif chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._done = True
        if self._sender is not None and not self._sender.done():
            self._sender.cancel()
        await self._ws.close()

    async def __aenter__(self) -> AsyncWsAudioStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _vc_form_data(source_audio: PromptAudio | None, **options) -> aiohttp.FormData:
    fields, files = vc_form(source_audio, **options)
    form = aiohttp.FormData()
    for key, value in fields.items():
        form.add_field(key, value)
    for key, (filename, data) in files.items():
        form.add_field(key, data, filename=filename, content_type="application/octet-stream")
    return form


class AsyncGatewayTTS:
    """asyncio client of the gateway (aiohttp). Same methods as `GatewayTTS`, awaited; `stream()` and
    `stream_ws()` are awaited once and then iterated with `async for`."""

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None, timeout_s: float = 600.0):
        self.url = (url if "://" in url else f"http://{url}").rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._session = None

    @property
    def session(self):
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s))
        return self._session

    async def _open(self, method: str, path: str, **kwargs):
        try:
            response = await self.session.request(method, self.url + path, **kwargs)
        except aiohttp.ClientConnectionError as exc:
            raise TTSError(f"cannot reach the gateway at {self.url}: {exc}", status="UNREACHABLE") from None
        if response.status >= 400:
            data = await response.read()
            response.release()
            raise error_from_body(data, response.status, response.headers.get("Retry-After"))
        return response

    async def _request(self, method: str, path: str, **kwargs) -> bytes:
        response = await self._open(method, path, **kwargs)
        try:
            return await response.read()
        finally:
            response.release()

    async def _json(self, method: str, path: str, payload: dict | None = None) -> dict:
        return json.loads(await self._request(method, path, json=payload))

    async def synthesize(self, text: str, **options) -> np.ndarray:
        body = {**tts_body(text, **options), "format": "pcm_f32"}
        data = await self._request("POST", "/v1/tts", json=body)
        return marked_audio(data) if options.get("marks") else np.frombuffer(data, "<f4").astype(np.float32)

    async def synthesize_wav(self, text: str, **options) -> bytes:
        return await self.synthesize_file(text, "wav", **options)

    async def synthesize_file(self, text: str, format: str = "wav", **options) -> bytes:
        return await self._request("POST", "/v1/tts", json={**tts_body(text, **options), "format": format})

    async def stream(self, text: str, **options) -> AsyncHttpAudioStream:
        body = {**tts_body(text, **options), "format": "pcm_f32", "stream": True}
        started = time.monotonic()
        stream = AsyncHttpEventStream if options.get("marks") else AsyncHttpAudioStream
        return stream(await self._open("POST", "/v1/tts", json=body), started)

    async def stream_ws(self, text: str | Iterable[str] | AsyncIterable[str] | None = None,
                        **options) -> AsyncWsAudioStream:
        start = {"type": "start", **tts_body(None, **options), "format": "pcm_f32"}
        if isinstance(text, str):
            start["text"] = text
        ws_url = "ws" + self.url[4:] + "/v1/tts/ws"
        try:
            ws = await self.session.ws_connect(ws_url, max_msg_size=0)
        except aiohttp.WSServerHandshakeError as exc:
            retry_after = exc.headers.get("Retry-After") if exc.headers else None
            raise TTSError(exc.message or f"WebSocket refused ({exc.status})", status=exc.status,
                           retry_after_s=retry_after_seconds(retry_after)) from None
        except aiohttp.ClientConnectionError as exc:
            raise TTSError(f"cannot reach the gateway at {self.url}: {exc}", status="UNREACHABLE") from None
        started = time.monotonic()
        stream = AsyncWsAudioStream(ws, started)
        stream.stats.speech_marks.wanted = bool(options.get("marks"))
        try:
            try:
                await ws.send_json(start)
                if isinstance(text, str):
                    await ws.send_json({"type": "end"})
            except ConnectionResetError:
                pass  # refused at once (the start was enough): its error message waits to be read next
            await stream._begin(None if isinstance(text, str) else text)
        except BaseException:
            await ws.close()
            raise
        return stream

    async def convert(self, source_audio: PromptAudio | None = None, **options) -> np.ndarray:
        """Voice conversion (POST /v1/vc), options as `GatewayTTS.convert`."""
        return np.frombuffer(await self.convert_file(source_audio, "pcm_f32", **options), "<f4").astype(np.float32)

    async def convert_file(self, source_audio: PromptAudio | None = None, format: str = "wav", **options) -> bytes:
        return await self._request("POST", "/v1/vc", data=_vc_form_data(source_audio, format=format, **options))

    async def convert_stream(self, source_audio: PromptAudio | None = None, **options) -> AsyncHttpAudioStream:
        started = time.monotonic()
        response = await self._open("POST", "/v1/vc", data=_vc_form_data(source_audio, stream=True, **options))
        return AsyncHttpAudioStream(response, started)

    async def speech(self, input: str, *, voice: str = "default", model: str = "tts-1",
                     response_format: str = "wav", instructions: str | None = None, seed: int | None = None) -> bytes:
        body = {"model": model, "input": input, "voice": voice, "response_format": response_format}
        if instructions is not None:
            body["instructions"] = instructions
        if seed is not None:
            body["seed"] = seed
        return await self._request("POST", "/v1/audio/speech", json=body)

    async def add_voice(self, audio: PromptAudio, prompt_text: str = "", *, voice_id: str | None = None,
                        name: str | None = None, sample_rate: int | None = None) -> VoiceInfo:
        fields, data, filename = _voice_form(audio, prompt_text, voice_id, name, sample_rate)
        form = aiohttp.FormData()
        for key, value in fields.items():
            form.add_field(key, value)
        form.add_field("audio", data, filename=filename, content_type="application/octet-stream")
        return voice_from_json(json.loads(await self._request("POST", "/v1/voices", data=form)))

    async def list_voices(self) -> list[VoiceInfo]:
        return [voice_from_json(v) for v in (await self._json("GET", "/v1/voices"))["voices"]]

    async def get_voice(self, voice_id: str) -> VoiceInfo:
        return voice_from_json(await self._json("GET", f"/v1/voices/{quote(voice_id, safe='')}"))

    async def delete_voice(self, voice_id: str) -> None:
        await self._json("DELETE", f"/v1/voices/{quote(voice_id, safe='')}")

    async def healthy(self) -> bool:
        try:
            return (await self._json("GET", "/healthz")).get("status") == "ok"
        except TTSError:
            return False

    async def ready(self) -> dict:
        try:
            return await self._json("GET", "/readyz")
        except TTSError as exc:
            return {"ready": False, "error": exc.message}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AsyncGatewayTTS:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
