"""How every HTTP route that speaks (/v1/tts, /v1/audio/speech, /v1/vc) answers with audio: `send_audio`.

Not streamed: the whole file, made by the offline model, with exact lengths in its header. Streamed: the first
chunk is awaited before any header goes out (so errors up to then are ordinary JSON errors), then one loop
encodes each chunk as Triton makes it (timing the stream's first audible audio: pipeline/audible.py) and
writes what the encoder gives, in one of two bodies: the audio
bytes themselves (`AudioBytes`; a failure after the headers cuts the connection, an incomplete chunked body,
never a short success) or OpenAI's server-sent events (`AudioEvents`; a failure ends with an error event).

Speech marks (a request with `marks`; pipeline/speech_marks.py): not streamed, the answer is JSON, the encoded
file in base64 beside the complete marks; streamed, the events are server-sent events among the audio deltas
(speech.mark before the audio it describes, speech.mark_end after a sentence's last audio) and speech.audio.done
carries the complete marks. (An HTTP trailer would need aiohttp to send trailers, which it does not, and the
clients we ship would not read one.)
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np
from aiohttp import web

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.audio_out import AudioEncoder, AudioFormat, encode
from cosyvoice_triton.pipeline.audible import AudibleDetector, first_audible
from cosyvoice_triton.pipeline.speech_marks import MarkList, mark_message

from . import access_log
from .fields import Fields
from .request_keys import ABORTED, client_left
from .state import CONFIG, METRICS
from .synthesis import WireRequest, stream_audio, whole_answer

log = logging.getLogger(__name__)


class AudioBytes:
    """A streamed body of the encoded audio bytes, in chunked transfer."""

    chunked = True

    def content_type(self, fmt: AudioFormat) -> str:
        return fmt.media_type

    async def write(self, response: web.StreamResponse, data: bytes) -> None:
        if data:  # an empty write would end a chunked body; encoders hold a few ms until a whole frame
            await response.write(data)

    async def mark(self, response: web.StreamResponse, event: dict) -> None:
        """A speech mark event: raw audio bytes have no place for one (a request with marks is answered with
        `AudioEvents`)."""

    async def finish(self, response: web.StreamResponse) -> None:
        """What follows the last audio bytes: nothing."""

    async def fail(self, request: web.Request, response: web.StreamResponse,
                   error: CosyVoiceError) -> web.StreamResponse:
        return abort(request, response)


AUDIO_BYTES = AudioBytes()


class AudioEvents(AudioBytes):
    """Server-sent events (OpenAI's stream_format "sse"): a speech.audio.delta for each piece of encoded bytes
    (base64), then speech.audio.done with the usage; a failure ends the stream with an error event. With
    `marks`: speech.mark / speech.mark_end events among the deltas, and the complete marks in speech.audio.done."""

    chunked = False

    def __init__(self, input_tokens: int, marks: bool = False):
        self.input_tokens = input_tokens
        self.marks = MarkList() if marks else None

    def content_type(self, fmt: AudioFormat) -> str:
        return "text/event-stream"

    async def write(self, response: web.StreamResponse, data: bytes) -> None:
        if data:
            await response.write(_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}))

    async def mark(self, response: web.StreamResponse, event: dict) -> None:
        if self.marks is not None:
            self.marks.add(event)
            await response.write(_event(mark_message(event, "speech.")))

    async def finish(self, response: web.StreamResponse) -> None:
        tokens = self.input_tokens
        done = {"type": "speech.audio.done",
                "usage": {"input_tokens": tokens, "output_tokens": 0, "total_tokens": tokens}}
        if self.marks is not None:
            done["marks"] = self.marks.marks
        await response.write(_event(done))

    async def fail(self, request: web.Request, response: web.StreamResponse,
                   error: CosyVoiceError) -> web.StreamResponse:
        await response.write(_event({"type": "error", "error": {"message": error.message, "code": error.code}}))
        await response.write_eof()
        return response


def _event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def audio_headers(request_id: str, seed: int, fmt: AudioFormat, sample_rate: int) -> dict[str, str]:
    return {"X-Request-Id": request_id, "X-Seed": str(seed), "X-Sample-Rate": str(fmt.output_rate(sample_rate)),
            "X-Audio-Format": fmt.name}


async def send_audio(request: web.Request, inputs: WireRequest, cost: float, fields: Fields, fmt: AudioFormat,
                     stream: bool, route: str, body: AudioBytes = AUDIO_BYTES,
                     family: str | None = None) -> web.StreamResponse:
    """Synthesize (or convert) the prepared request with `family`'s servers (None: the default family) and answer:
    the whole file, or `body` streamed."""
    app = request.app
    metrics, config = app[METRICS], app[CONFIG]
    rate = config.sample_rate
    request_id = uuid.uuid4().hex
    accepted = time.monotonic()
    headers = {**audio_headers(request_id, inputs.seed, fmt, rate), "Content-Type": body.content_type(fmt)}
    if not stream:  # the offline model: one full-attention flow pass per sentence, as the official offline path
        audio, marks = await whole_answer(app, inputs, cost, fields, request_id, family)
        await observe_whole_answer(request, route, audio, accepted)
        data = await asyncio.to_thread(encode, audio, fmt, rate)
        if getattr(inputs, "marks", False):  # the file in base64 beside the complete marks
            headers.pop("Content-Type")
            return web.json_response({"audio": base64.b64encode(data).decode("ascii"), "format": fmt.name,
                                      "sample_rate": fmt.output_rate(rate), "seed": inputs.seed, "marks": marks},
                                     headers=headers)
        return web.Response(body=data, headers=headers)
    chunks = stream_audio(app, inputs, cost, fields, request_id, family)
    async with aclosing(chunks):
        first = await anext(chunks, None)
        metrics.first_chunk.labels(route).observe(time.monotonic() - accepted)
        access_log.first_chunk(request, time.monotonic() - accepted)
        response = web.StreamResponse(headers={**headers, "Cache-Control": "no-store"})
        if body.chunked:
            response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            return await _write_stream(request, response, first, chunks, fmt, route, body, request_id, accepted)
        except ConnectionError:
            if request.transport is not None and not request.transport.is_closing():
                raise  # not from a write to a closing connection
            client_left(request)  # a write failed because the client went away
            return response


async def _write_stream(request: web.Request, response: web.StreamResponse, first: np.ndarray | dict | None,
                        chunks: AsyncIterator[np.ndarray | dict], fmt: AudioFormat, route: str, body: AudioBytes,
                        request_id: str, accepted: float) -> web.StreamResponse:
    """The one encode loop: each chunk fed to the encoder, what it gives written as `body` says. A write that
    fails because the client went away raises ConnectionError (`send_audio` counts it as the client's leaving)."""
    metrics, config = request.app[METRICS], request.app[CONFIG]
    rate = config.sample_rate
    samples = 0
    metrics.active_streams.labels(route).inc()
    encoder = AudioEncoder(fmt, rate)
    audible = AudibleDetector(rate, config.audible_threshold_dbfs)
    try:
        chunk = first
        while chunk is not None:
            if isinstance(chunk, dict):  # a speech mark event: before the audio it describes
                await body.mark(response, chunk)
                chunk = await anext(chunks, None)
                continue
            if audible.feed(chunk, time.monotonic()):
                observe_first_audible(request, route, audible.at - accepted)
            await body.write(response, encoder.feed(chunk))
            samples += chunk.size
            chunk = await anext(chunks, None)
        if audible.finish():
            observe_first_audible(request, route, audible.at - accepted)
        await body.write(response, encoder.finish())
        await body.finish(response)
        await response.write_eof()
    except CosyVoiceError as exc:
        metrics.errors.labels(exc.code).inc()
        log.warning("request %s: stream failed after %.2f s of audio: %s", request_id, samples / rate, exc)
        return await body.fail(request, response, exc)
    finally:
        encoder.close()
        metrics.active_streams.labels(route).dec()
        metrics.audio_seconds.labels(route).inc(samples / rate)
        access_log.audio_sent(request, samples / rate)
    return response


async def observe_whole_answer(request: web.Request, route: str, audio: np.ndarray, accepted: float) -> None:
    """A whole answer's figures (its audio comes at once): first chunk and, when it holds an audible sample,
    first audible audio at `accepted` -> now; its audio seconds; in the metrics and the access line."""
    app = request.app
    metrics, config = app[METRICS], app[CONFIG]
    waited = time.monotonic() - accepted
    metrics.first_chunk.labels(route).observe(waited)
    access_log.first_chunk(request, waited)
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if await asyncio.to_thread(first_audible, audio, config.sample_rate, config.audible_threshold_dbfs) is not None:
        observe_first_audible(request, route, time.monotonic() - accepted)
    metrics.audio_seconds.labels(route).inc(audio.size / config.sample_rate)
    access_log.audio_sent(request, audio.size / config.sample_rate)


def observe_first_audible(request: web.Request, route: str, seconds: float) -> None:
    """The chunk holding the first audible sample went out `seconds` after the request was accepted."""
    request.app[METRICS].first_audible.labels(route).observe(seconds)
    access_log.first_audible(request, seconds)


def abort(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Cut the connection of a response that failed after its headers went out, so that the client sees an
    incomplete chunked body rather than a short success (aiohttp then skips the end of the body quietly)."""
    request[ABORTED] = True
    if request.transport is not None:
        request.transport.abort()
    return response
