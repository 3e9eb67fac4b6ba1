"""POST /v1/audio/speech: the OpenAI text-to-speech API, so OpenAI SDKs and tools work unchanged.

  model            required string; any value is accepted (tts-1, gpt-4o-mini-tts, cosyvoice2 ...)
  input            the text
  voice            a registered voice id (or {"id": ...}); OpenAI's stock names (alloy, echo, ...) that
                   are not registered here speak with the "default" voice
  response_format  mp3 (the default, as OpenAI's) | opus (Ogg, 48 kHz) | aac (ADTS) | flac | wav | pcm
                   (16-bit little-endian, 24 kHz, no header); encoded by cosyvoice_triton/audio_out.py
  speed            0.25 .. 4.0 as OpenAI's (default 1.0): the mel is interpolated along time by 1 / speed
                   before the vocoder, as the official CosyVoice2 does, streamed or not (token2wav/speed.py);
                   outside the range: 400 naming `speed`
  instructions     switches to instruct2 mode with this instruction
  stream_format    audio (default): the audio bytes, streamed as they are encoded | sse: server-sent events
                   speech.audio.delta {audio: base64 of the next bytes of the file} ... then speech.audio.done
  seed             (extension) as in /v1/tts
  stream           (extension) true (default): chunked transfer, so `with_streaming_response` reads audio as
                   it is made (a wav then says "unknown length" in its header, as FFmpeg writes it on a
                   pipe; soundfile, FFmpeg and browsers read it to its end); false: the whole file, whose
                   header carries the exact lengths
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from contextlib import aclosing

from aiohttp import web

from cosyvoice_triton.audio_out import AudioEncoder, AudioFormat
from cosyvoice_triton.errors import NotFound

from . import access_log
from .auth import limit_key
from .errors import BadRequest, GatewayError
from .routes_tts import abort, audio_headers, check_format, json_body, send_audio
from .state import CONFIG, COSTS, LIMITER, METRICS, STORE
from .synthesis import OPENAI_FIELDS, prepare, stream_audio

OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
                           "verse", "marin", "cedar"})
OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")  # OpenAI's response_format values


async def _voice(app: web.Application, voice: object) -> str:
    if isinstance(voice, dict):
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise BadRequest("voice", "is required: a registered voice id, or {\"id\": ...}")
    if voice.lower() in OPENAI_VOICES:
        try:
            await asyncio.to_thread(app[STORE].info, voice)
        except NotFound:
            return "default"
        except Exception:  # noqa: BLE001 - a malformed id: let the checks name it
            return voice
    return voice


async def speech(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = await json_body(request)
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("model", "is required (any model name is accepted, e.g. \"cosyvoice2\")")
    fmt = check_format(body.get("response_format", "mp3"), "response_format", OPENAI_FORMATS)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "must be true or false")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise BadRequest("stream_format", f"must be audio or sse, got {stream_format!r}")
    instructions = body.get("instructions") or None
    synthesis = await prepare(app, text=body.get("input"), voice_id=await _voice(app, body.get("voice")),
                              mode="instruct2" if instructions else "zero_shot", instruct=instructions,
                              seed=body.get("seed"), speed=body.get("speed", 1.0), fields=OPENAI_FIELDS)
    with app[LIMITER].slot(limit_key(request)):
        if stream_format == "sse":
            return await _send_events(request, synthesis, fmt)
        return await send_audio(request, synthesis, fmt, stream=stream, route="openai")


async def _send_events(request: web.Request, synthesis, fmt: AudioFormat) -> web.StreamResponse:
    """Server-sent events: a speech.audio.delta for each chunk's encoded bytes (base64; none while the encoder
    holds them), then one for what finishing the file adds, then speech.audio.done."""
    app = request.app
    metrics, rate = app[METRICS], app[CONFIG].sample_rate
    request_id = uuid.uuid4().hex
    accepted = time.monotonic()
    chunks = stream_audio(app, synthesis, request_id)
    async with aclosing(chunks):
        first = await anext(chunks, None)
        metrics.first_chunk.labels("openai").observe(time.monotonic() - accepted)
        access_log.first_chunk(request, time.monotonic() - accepted)
        response = web.StreamResponse(headers={**audio_headers(request_id, synthesis, fmt, rate),
                                               "Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await response.prepare(request)
        samples = 0
        encoder = AudioEncoder(fmt, rate)
        try:
            chunk = first
            while chunk is not None:
                await _write_delta(response, encoder.feed(chunk))
                samples += chunk.size
                chunk = await anext(chunks, None)
            await _write_delta(response, encoder.finish())
        except GatewayError as exc:  # the stream ends with an error event
            metrics.errors.labels(exc.code).inc()
            await response.write(_event({"type": "error", "error": {"message": exc.message, "code": exc.code}}))
            await response.write_eof()
            return response
        except ConnectionError:
            return abort(request, response)
        finally:
            encoder.close()
        metrics.audio_seconds.labels("openai").inc(samples / rate)
        access_log.audio_sent(request, samples / rate)
        tokens = app[COSTS].text_tokens(synthesis.text)
        await response.write(_event({"type": "speech.audio.done",
                                     "usage": {"input_tokens": tokens, "output_tokens": 0, "total_tokens": tokens}}))
        await response.write_eof()
        return response


async def _write_delta(response: web.StreamResponse, data: bytes) -> None:
    if data:
        audio = base64.b64encode(data).decode("ascii")
        await response.write(_event({"type": "speech.audio.delta", "audio": audio}))


def _event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", speech)
