"""POST /v1/audio/speech: the OpenAI text-to-speech API, so OpenAI SDKs and tools work unchanged.

  model            required string; any value is accepted (tts-1, gpt-4o-mini-tts, cosyvoice2 ...)
  input            the text
  voice            a registered voice id (or {"id": ...}); OpenAI's stock names (alloy, echo, ...) that
                   are not registered here speak with the "default" voice
  response_format  wav (16-bit, the default here) | pcm (16-bit little-endian, 24 kHz, as OpenAI's);
                   mp3, opus, aac and flac are refused with 400
  speed            checked (0.25 .. 4.0) and otherwise ignored: CosyVoice2 has no speed control
  instructions     switches to instruct2 mode with this instruction
  stream_format    audio (default): the audio bytes, streamed as they are made | sse: server-sent events
                   speech.audio.delta {audio: base64} ... then speech.audio.done
  seed             (extension) as in /v1/tts
The body is always streamed (chunked transfer): `with_streaming_response` reads chunks as they come.
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from contextlib import aclosing

from aiohttp import web

from cosyvoice_triton.errors import NotFound

from .audio_format import pcm_bytes
from .auth import limit_key
from .errors import BadRequest, GatewayError
from .routes_tts import abort, audio_headers, json_body, send_audio
from .state import CONFIG, COSTS, LIMITER, METRICS, STORE
from .synthesis import OPENAI_FIELDS, prepare, stream_audio

OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
                           "verse", "marin", "cedar"})
FORMATS = {"wav": ("wav", "audio/wav"), "pcm": ("pcm_s16le", "audio/pcm")}
UNSUPPORTED = ("mp3", "opus", "aac", "flac")


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
    response_format = body.get("response_format", "wav")
    if response_format in UNSUPPORTED:
        raise BadRequest("response_format", f"{response_format!r} is not supported here; use wav or pcm")
    if response_format not in FORMATS:
        raise BadRequest("response_format", f"must be wav or pcm, got {response_format!r}")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
        raise BadRequest("speed", "must be a number from 0.25 to 4.0 (it is accepted and ignored)")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise BadRequest("stream_format", f"must be audio or sse, got {stream_format!r}")
    instructions = body.get("instructions") or None
    synthesis = await prepare(app, text=body.get("input"), voice_id=await _voice(app, body.get("voice")),
                              mode="instruct2" if instructions else "zero_shot", instruct=instructions,
                              seed=body.get("seed"), fields=OPENAI_FIELDS)
    fmt, content_type = FORMATS[response_format]
    with app[LIMITER].slot(limit_key(request)):
        if stream_format == "sse":
            return await _send_events(request, synthesis, fmt)
        return await send_audio(request, synthesis, fmt, stream=True, route="openai", content_type=content_type)


async def _send_events(request: web.Request, synthesis, fmt: str) -> web.StreamResponse:
    """Server-sent events: one speech.audio.delta per chunk (base64 of `fmt` bytes), then speech.audio.done."""
    app = request.app
    metrics, rate = app[METRICS], app[CONFIG].sample_rate
    request_id = uuid.uuid4().hex
    accepted = time.monotonic()
    chunks = stream_audio(app, synthesis, request_id)
    async with aclosing(chunks):
        first = await anext(chunks, None)
        metrics.first_chunk.labels("openai").observe(time.monotonic() - accepted)
        response = web.StreamResponse(headers={**audio_headers(request_id, synthesis, fmt, rate),
                                               "Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await response.prepare(request)
        samples = 0
        try:
            chunk = first
            while chunk is not None:
                audio = base64.b64encode(pcm_bytes(chunk, fmt)).decode("ascii")
                await response.write(_event({"type": "speech.audio.delta", "audio": audio}))
                samples += chunk.size
                chunk = await anext(chunks, None)
        except GatewayError as exc:  # the stream ends with an error event
            metrics.errors.labels(exc.code).inc()
            await response.write(_event({"type": "error", "error": {"message": exc.message, "code": exc.code}}))
            await response.write_eof()
            return response
        except ConnectionError:
            return abort(request, response)
        metrics.audio_seconds.labels("openai").inc(samples / rate)
        tokens = app[COSTS].text_tokens(synthesis.text)
        await response.write(_event({"type": "speech.audio.done",
                                     "usage": {"input_tokens": tokens, "output_tokens": 0, "total_tokens": tokens}}))
        await response.write_eof()
        return response


def _event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", speech)
