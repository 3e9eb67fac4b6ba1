"""POST /v1/tts: text -> 24 kHz audio, whole or streamed.

Body (JSON):
  text          required, at most --max-text-chars characters
  voice_id      a registered voice (default: "default"); or
  prompt_audio  base64 of a WAV/FLAC/OGG file, with prompt_text (its transcript; zero_shot needs it)
  mode          zero_shot (default) | cross_lingual | instruct2
  instruct      the instruction (instruct2)
  text_frontend false: the text as given: no normalization, no sentence splitting (official text_frontend=False; default true)
  speed         0.25 .. 4.0 (default 1.0): the mel interpolated along time by 1 / speed before the vocoder, as the
                official CosyVoice2, streamed or not (token2wav/speed.py); outside the range: 400 naming `speed`
  seed          0 .. 2^63-1: the same seed and inputs give the same audio (default: random, echoed in X-Seed)
  chunk_first_hop, chunk_hop_scale, chunk_max_hop
                the streaming chunk policy (pipeline/chunk_policy.py; default: the server's): speech tokens in
                the first chunk (int >= 4; smaller: earlier first audio), the growth of each later chunk
                (number in [1, 16]) and its cap (int >= the first hop). The chunking changes where the flow
                model's chunks fall, so the audio may differ slightly from the default's
  chunk_policy  fixed (the official schedule) | adaptive (hops follow the listener's lead; default: the server's)
  format        wav (default, 16-bit) | mp3 | opus | aac | flac | pcm (16-bit little-endian) | pcm_f32 (the
                model's float32 samples); pcm_s16le is an older name of pcm. cosyvoice_triton/audio_out.py
                lists codecs, rates and media types (opus is 48 kHz; X-Sample-Rate says the rate)
  stream        false (default): the whole file with Content-Length and exact lengths in its header, made by
                the offline model (cosyvoice2_offline: each sentence in one full-attention flow pass, as the
                official non-streamed inference; the chunk_* fields then change nothing);
                true: chunked transfer, each audio chunk encoded as Triton makes it and written as soon as
                the encoder gives bytes (a streamed wav's header says "unknown length", as FFmpeg writes
                it on a pipe)

Errors before the first audio byte are JSON with a status (400 naming the field, 404 unknown voice,
429, 503 no server or "overloaded" with Retry-After (admission: gateway/admission.py), 504 timeout); a
failure after it cuts the connection (an incomplete chunked body, never a clean end).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing

from aiohttp import web

from cosyvoice_triton.audio_out import ALIASES, FORMATS, AudioEncoder, AudioFormat, audio_format, encode

from . import access_log
from .auth import limit_key
from .errors import BadRequest, GatewayError
from .fields import resolve_aliases
from .request_keys import ABORTED
from .state import CONFIG, LIMITER, METRICS
from .synthesis import TTS_FIELDS, Synthesis, decode_base64, prepare, stream_audio, whole_audio

log = logging.getLogger(__name__)

TTS_KEYS = frozenset({"text", "voice_id", "voice", "prompt_audio", "prompt_text", "mode", "instruct", "seed",
                      "chunk_first_hop", "chunk_hop_scale", "chunk_max_hop", "chunk_policy", "format", "stream"}) | {"text_frontend", "speed"}
TTS_FORMATS = (*FORMATS, *ALIASES)  # the formats of /v1/tts and the WebSocket


async def json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("body", "is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body


def check_format(value: object, field: str, names: tuple[str, ...] = TTS_FORMATS) -> AudioFormat:
    """The audio format a request names in `field`, one of `names`."""
    if not isinstance(value, str) or value not in names:
        raise BadRequest(field, f"must be one of {', '.join(names)}, got {value!r}")
    return audio_format(value)


def audio_headers(request_id: str, synthesis: Synthesis, fmt: AudioFormat, sample_rate: int) -> dict[str, str]:
    return {"X-Request-Id": request_id, "X-Seed": str(synthesis.seed),
            "X-Sample-Rate": str(fmt.output_rate(sample_rate)), "X-Audio-Format": fmt.name}


async def send_audio(request: web.Request, synthesis: Synthesis, fmt: AudioFormat, stream: bool,
                     route: str) -> web.StreamResponse:
    """Synthesize and answer: the whole file, or chunks encoded as they come. The first chunk is awaited
    before any header goes out, so errors up to then are ordinary JSON errors."""
    app = request.app
    metrics, rate = app[METRICS], app[CONFIG].sample_rate
    request_id = uuid.uuid4().hex
    accepted = time.monotonic()
    headers = {**audio_headers(request_id, synthesis, fmt, rate), "Content-Type": fmt.media_type}
    if not stream:  # the offline model: one full-attention flow pass per sentence, as the official offline path
        audio = await whole_audio(app, synthesis, request_id)
        metrics.first_chunk.labels(route).observe(time.monotonic() - accepted)
        metrics.audio_seconds.labels(route).inc(audio.size / rate)
        access_log.first_chunk(request, time.monotonic() - accepted)
        access_log.audio_sent(request, audio.size / rate)
        body = await asyncio.to_thread(encode, audio, fmt, rate)
        return web.Response(body=body, headers=headers)
    chunks = stream_audio(app, synthesis, request_id)
    async with aclosing(chunks):
        first = await anext(chunks, None)
        metrics.first_chunk.labels(route).observe(time.monotonic() - accepted)
        access_log.first_chunk(request, time.monotonic() - accepted)
        response = web.StreamResponse(headers={**headers, "Cache-Control": "no-store"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        samples = 0
        metrics.active_streams.labels(route).inc()
        encoder = AudioEncoder(fmt, rate)
        try:
            chunk = first
            while chunk is not None:
                await write_some(response, encoder.feed(chunk))
                samples += chunk.size
                chunk = await anext(chunks, None)
            await write_some(response, encoder.finish())
        except GatewayError as exc:
            metrics.errors.labels(exc.code).inc()
            log.warning("request %s: stream cut after %.2f s of audio: %s", request_id, samples / rate, exc)
            return abort(request, response)
        except ConnectionError:  # the client went away while we wrote
            return abort(request, response)
        finally:
            encoder.close()
            metrics.active_streams.labels(route).dec()
            metrics.audio_seconds.labels(route).inc(samples / rate)
            access_log.audio_sent(request, samples / rate)
        await response.write_eof()
        return response


async def write_some(response: web.StreamResponse, data: bytes) -> None:
    """One chunked write, when the encoder gave bytes (an empty write would end a chunked body)."""
    if data:
        await response.write(data)


def abort(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Cut the connection of a response whose headers went out, so that the client sees an incomplete
    chunked body rather than a short success (aiohttp then skips the end of the body quietly)."""
    request[ABORTED] = True
    if request.transport is not None:
        request.transport.abort()
    return response


async def tts(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = await json_body(request)
    unknown = sorted(set(body) - TTS_KEYS)
    if unknown:
        raise BadRequest(unknown[0], f"is not a field of /v1/tts (fields: {', '.join(sorted(TTS_KEYS))})")
    fmt = check_format(body.get("format", "wav"), "format")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "must be true or false")
    body = resolve_aliases(body)
    prompt_audio = body.get("prompt_audio")
    if prompt_audio is not None:
        prompt_audio = decode_base64(prompt_audio, "prompt_audio", app[CONFIG].limits.max_upload_bytes)
    synthesis = await prepare(app, text=body.get("text"), voice_id=body.get("voice_id"),
                              prompt_audio=prompt_audio, prompt_text=body.get("prompt_text"), mode=body.get("mode"),
                              instruct=body.get("instruct"), seed=body.get("seed"),
                              chunk_first_hop=body.get("chunk_first_hop"), chunk_hop_scale=body.get("chunk_hop_scale"),
                              chunk_max_hop=body.get("chunk_max_hop"), text_frontend=body.get("text_frontend"), chunk_policy=body.get("chunk_policy"),
                              speed=body.get("speed"),
                              fields=TTS_FIELDS)
    with app[LIMITER].slot(limit_key(request)):
        return await send_audio(request, synthesis, fmt, stream, route="tts")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/tts", tts)

