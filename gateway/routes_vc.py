"""POST /v1/vc: voice conversion (the official inference_vc): a source recording spoken again in a voice.

Body (multipart/form-data):
  audio         required: the source recording, a WAV/FLAC/OGG file of 0.2 s to 10 min (longer than 30 s: cut
                into pieces of at most 30 s at quiet frames and spoken in order, pipeline/voice_conversion.py)
  voice_id      a registered voice (default: "default"); or
  prompt_audio  a target recording (WAV/FLAC/OGG file, 0.5 to 30 s) whose voice is used (no transcript needed)
  seed          as on /v1/tts (default: random, echoed in X-Seed)
  speed         0.25 .. 4.0 (default 1.0), as on /v1/tts and the official inference_vc
  format        as on /v1/tts (default wav)
  stream        "false" (default): the whole file, each piece in one full-attention flow pass (cosyvoice2_offline);
                "true": chunked transfer, each piece on the streaming chunk schedule (cosyvoice2)
The answer is the audio as on /v1/tts (headers X-Seed, X-Sample-Rate, X-Audio-Format); errors are JSON with
the status and the field (400 naming audio, voice_id, prompt_audio, seed, speed, format or stream; 404 unknown
voice).
No text and no LLM: the source's speech tokens go through the voice's flow prompt, then the vocoder.

The WebSocket takes the same conversion as a message, {"type": "vc", "audio": base64 of the source}, spoken in
the session's voice and speed (`ws_conversion`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import numpy as np
from aiohttp import web

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import check_speed
from cosyvoice_triton.preprocess.audio import decode_audio
from cosyvoice_triton.pipeline.voice_conversion import validate_source_audio
from cosyvoice_triton.triton.contracts import conversion_inputs

from .auth import limit_key
from .default_voice import VOICE_ID as DEFAULT_VOICE_ID
from .errors import BadRequest, PayloadTooLarge
from .routes_tts import check_format, send_audio
from .routing import TOKENS_PER_SECOND
from .state import CONFIG, COSTS, LIMITER
from .synthesis import Fields, check_seed, decode_base64, optional_string, prompt_audio_tokens, voice_info

VC_KEYS = frozenset({"audio", "voice_id", "prompt_audio", "seed", "speed", "format", "stream"})
SOURCE_INPUTS = ("source_audio", "source_wav", "source_sample_rate")


@dataclass(frozen=True)
class ConversionFields(Fields):
    """Field names of /v1/vc (and the WebSocket's vc message) for errors; the source is `audio`."""

    source: str = "audio"

    def of_model_input(self, name: str | None) -> str | None:
        return self.source if name in SOURCE_INPUTS else super().of_model_input(name)


VC_FIELDS = ConversionFields()


@dataclass(frozen=True)
class VoiceConversion:
    """One checked conversion, sent as `Synthesis` is (`stream_audio`, `whole_audio` and `send_audio` take it)."""

    source: bytes  # the source recording's file bytes
    voice_id: str | None
    prompt_audio: bytes | None  # or a target recording's file bytes
    seed: int
    cost: float
    speed: float | None = None  # None: 1.0
    fields: Fields = VC_FIELDS

    def inputs(self, seed: int | None = None) -> dict[str, np.ndarray]:
        """The cosyvoice2 request in mode vc (contracts.py)."""
        return conversion_inputs(source_file=self.source, voice_id=self.voice_id, audio_file=self.prompt_audio,
                                 seed=self.seed if seed is None else seed, speed=self.speed)

    def with_seed(self, seed: int) -> VoiceConversion:
        return replace(self, seed=seed)


async def prepare_conversion(app: web.Application, *, source: bytes | None, voice_id: object = None,
                             prompt_audio: bytes | None = None, seed: object = None,
                             speed: float | None = None) -> VoiceConversion:
    """Check a conversion and resolve its voice (none given: "default"); errors name /v1/vc's fields."""
    fields, limit = VC_FIELDS, app[CONFIG].limits.max_upload_bytes
    if not source:
        raise BadRequest(fields.source, "is required: the recording to convert (a WAV, FLAC or OGG file)")
    for field, data in ((fields.source, source), (fields.prompt_audio, prompt_audio)):
        if data is not None and len(data) > limit:
            raise PayloadTooLarge.upload(field, len(data), limit, field)
    source_tokens = await asyncio.to_thread(_source_tokens, source, fields.source)
    seed = check_seed(seed, fields.seed)
    voice_id = optional_string(voice_id, fields.voice) or None
    prompt_tokens = await prompt_audio_tokens(voice_id, prompt_audio, fields)
    if prompt_tokens is None:
        voice_id = DEFAULT_VOICE_ID if voice_id is None else voice_id
        prompt_tokens = (await voice_info(app, voice_id, fields.voice)).tokens
    cost = app[COSTS].estimate("", prompt_tokens + source_tokens, True)  # the source is encoded, no text
    return VoiceConversion(source=source, voice_id=voice_id, prompt_audio=prompt_audio, seed=seed, cost=cost,
                           speed=speed)


def _source_tokens(data: bytes, field: str) -> int:
    """Decode and check a source recording; its speech tokens (25 per second)."""
    try:
        samples, rate = decode_audio(data, field)
        validate_source_audio(samples, rate, field)
    except InvalidInput as exc:
        raise BadRequest(field, exc.problem) from None
    return int(samples.shape[0] / rate * TOKENS_PER_SECOND)


async def _form(request: web.Request) -> dict:
    """The multipart fields: bytes for the two recordings, strings for the rest."""
    if request.content_type != "multipart/form-data":
        raise BadRequest("body", "send multipart/form-data: audio (the source recording), voice_id or prompt_audio, "
                                 "seed, format, stream")
    form = await request.post()  # bounded by client_max_size: 413 beyond
    unknown = sorted(set(form) - VC_KEYS)
    if unknown:
        raise BadRequest(unknown[0], f"is not a field of /v1/vc (fields: {', '.join(sorted(VC_KEYS))})")
    values: dict = {}
    for key, value in form.items():
        if key in ("audio", "prompt_audio"):
            values[key] = value.file.read() if isinstance(value, web.FileField) else str(value).encode()
        elif isinstance(value, web.FileField):
            values[key] = value.file.read().decode("utf-8", "replace")
        else:
            values[key] = value
    return values


def _form_seed(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest("seed", f"must be an integer, got {value!r}") from None


def _form_speed(value: str | None) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(check_speed(float(value)))
    except (ValueError, InvalidInput):
        raise BadRequest("speed", f"must be a number from 0.25 to 4.0, got {value!r}") from None


def _form_stream(value: str | None) -> bool:
    if value in (None, "", "false", "0"):
        return False
    if value in ("true", "1"):
        return True
    raise BadRequest("stream", f"must be true or false, got {value!r}")


async def vc(request: web.Request) -> web.StreamResponse:
    app = request.app
    form = await _form(request)
    fmt = check_format(form.get("format", "wav"), "format")
    stream = _form_stream(form.get("stream"))
    conversion = await prepare_conversion(app, source=form.get("audio"), voice_id=form.get("voice_id"),
                                          prompt_audio=form.get("prompt_audio"), seed=_form_seed(form.get("seed")),
                                          speed=_form_speed(form.get("speed")))
    with app[LIMITER].slot(limit_key(request)):
        return await send_audio(request, conversion, fmt, stream, route="vc")


async def ws_conversion(app: web.Application, message: dict, base) -> VoiceConversion:
    """A WebSocket {"type": "vc", "audio": base64} message as a conversion in the session's voice and seed
    (`base`: the session's `Synthesis`); the session then sets the segment's seed."""
    unknown = sorted(set(message) - {"type", "audio"})
    if unknown:
        raise BadRequest(unknown[0], "is not a field of the vc message (fields: type, audio)")
    source = decode_base64(message.get("audio"), "audio", app[CONFIG].limits.max_upload_bytes)
    source_tokens = await asyncio.to_thread(_source_tokens, source, "audio")
    cost = app[COSTS].estimate("", base.prompt_tokens + source_tokens, True)
    return VoiceConversion(source=source, voice_id=base.voice_id, prompt_audio=base.prompt_audio, seed=base.seed,
                           cost=cost, speed=base.speed)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/vc", vc)
