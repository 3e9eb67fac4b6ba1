"""POST /v1/tts: text -> 24 kHz audio, whole or streamed.

Body (JSON):
  text          required, at most --max-text-chars characters
  voice_id      a registered voice (default: "default"); or
  prompt_audio  base64 of a WAV/FLAC/OGG file, with prompt_text (its transcript; zero_shot needs it)
  mode          zero_shot (default) | cross_lingual | instruct2
  instruct      the instruction (instruct2)
  seed          0 .. 2^63-1: the same seed and inputs give the same audio (default: random, echoed in X-Seed)
  chunk_first_hop, chunk_hop_scale, chunk_max_hop
                the streaming chunk policy (runtime/chunk_policy.py; default: the server's): speech tokens in
                the first chunk (int >= 4; smaller: earlier first audio), the growth of each later chunk
                (number in [1, 16]) and its cap (int >= the first hop). The chunking changes where the flow
                model's chunks fall, so the audio may differ slightly from the default's
  format        wav (default, 16-bit) | pcm_f32 | pcm_s16le
  stream        false (default): the whole file with Content-Length; true: chunked transfer, one write
                per audio chunk as Triton makes it (a wav stream starts with a header of unknown length)

Errors before the first audio byte are JSON with a status (400 naming the field, 404 unknown voice,
429, 503 no server, 504 timeout); a failure after it cuts the connection (an incomplete body).
"""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing

import numpy as np
from aiohttp import web

from .audio_format import CONTENT_TYPES, FORMATS, pcm_bytes, wav_bytes, wav_header
from .auth import limit_key
from .errors import BadRequest, GatewayError
from .request_keys import ABORTED
from .state import CONFIG, LIMITER, METRICS
from .synthesis import TTS_FIELDS, Synthesis, decode_base64, prepare, stream_audio

log = logging.getLogger(__name__)

TTS_KEYS = frozenset({"text", "voice_id", "voice", "prompt_audio", "prompt_text", "mode", "instruct", "seed",
                      "chunk_first_hop", "chunk_hop_scale", "chunk_max_hop", "format", "stream"})


async def json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("body", "is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body


def audio_headers(request_id: str, synthesis: Synthesis, fmt: str, sample_rate: int) -> dict[str, str]:
    return {"X-Request-Id": request_id, "X-Seed": str(synthesis.seed), "X-Sample-Rate": str(sample_rate),
            "X-Audio-Format": fmt}


async def send_audio(request: web.Request, synthesis: Synthesis, fmt: str, stream: bool, route: str,
                     content_type: str | None = None) -> web.StreamResponse:
    """Synthesize and answer: the whole audio, or chunks as they come. The first chunk is awaited before
    any header goes out, so errors up to then are ordinary JSON errors."""
    app = request.app
    metrics, rate = app[METRICS], app[CONFIG].sample_rate
    request_id = uuid.uuid4().hex
    accepted = time.monotonic()
    headers = audio_headers(request_id, synthesis, fmt, rate)
    content_type = content_type or CONTENT_TYPES[fmt]
    chunks = stream_audio(app, synthesis, request_id)
    async with aclosing(chunks):
        first = await anext(chunks, None)
        metrics.first_chunk.labels(route).observe(time.monotonic() - accepted)
        if not stream:
            parts = [first] if first is not None else []
            parts += [chunk async for chunk in chunks]
            audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
            metrics.audio_seconds.labels(route).inc(audio.size / rate)
            body = wav_bytes(audio, rate) if fmt == "wav" else pcm_bytes(audio, fmt)
            return web.Response(body=body, headers={**headers, "Content-Type": content_type})

        response = web.StreamResponse(headers={**headers, "Content-Type": content_type,
                                               "Cache-Control": "no-store"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        samples = 0
        metrics.active_streams.labels(route).inc()
        try:
            if fmt == "wav":
                await response.write(wav_header(rate, None))
            chunk = first
            while chunk is not None:
                await response.write(pcm_bytes(chunk, fmt))
                samples += chunk.size
                chunk = await anext(chunks, None)
        except GatewayError as exc:
            metrics.errors.labels(exc.code).inc()
            log.warning("request %s: stream cut after %.2f s of audio: %s", request_id, samples / rate, exc)
            return abort(request, response)
        except ConnectionError:  # the client went away while we wrote
            return abort(request, response)
        finally:
            metrics.active_streams.labels(route).dec()
            metrics.audio_seconds.labels(route).inc(samples / rate)
        await response.write_eof()
        return response


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
    fmt = body.get("format", "wav")
    if fmt not in FORMATS:
        raise BadRequest("format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "must be true or false")
    if "voice_id" in body and "voice" in body:
        raise BadRequest("voice", "give voice_id (or its alias voice), not both")
    prompt_audio = body.get("prompt_audio")
    if prompt_audio is not None:
        prompt_audio = decode_base64(prompt_audio, "prompt_audio", app[CONFIG].limits.max_upload_bytes)
    synthesis = await prepare(app, text=body.get("text"), voice_id=body.get("voice_id", body.get("voice")),
                              prompt_audio=prompt_audio, prompt_text=body.get("prompt_text"), mode=body.get("mode"),
                              instruct=body.get("instruct"), seed=body.get("seed"),
                              chunk_first_hop=body.get("chunk_first_hop"), chunk_hop_scale=body.get("chunk_hop_scale"),
                              chunk_max_hop=body.get("chunk_max_hop"), fields=TTS_FIELDS)
    with app[LIMITER].slot(limit_key(request)):
        return await send_audio(request, synthesis, fmt, stream, route="tts")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/tts", tts)

