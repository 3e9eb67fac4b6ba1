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
the session's voice and speed (`synthesis.conversion_in_voice`). The form is parsed once into a `VcRequest`
(route_requests.py); the gateway decodes both recordings once and sends their samples.
"""
from __future__ import annotations

from aiohttp import web

from cosyvoice_triton.errors import InvalidInput

from .audio_response import send_audio
from .auth import limit_key
from .route_requests import parse_vc
from .state import CONFIG, LIMITER
from .synthesis import prepare_conversion, routing_cost


async def vc(request: web.Request) -> web.StreamResponse:
    app = request.app
    vc = parse_vc(await _form(request), app[CONFIG].limits)
    inputs, prompt_tokens = await prepare_conversion(app, vc.inputs, vc.fields)  # /v1/tts's names, and source_audio
    with app[LIMITER].slot(limit_key(request)):
        return await send_audio(request, inputs, routing_cost(app, inputs, prompt_tokens), vc.fields, vc.format,
                                vc.stream, route="vc")


async def _form(request: web.Request) -> dict:
    """The multipart fields: bytes for the two recordings, strings for the rest."""
    if request.content_type != "multipart/form-data":
        raise InvalidInput("body", "send multipart/form-data: source_audio (the recording), voice_id or prompt_audio, "
                                   "seed, format, stream")
    form = await request.post()  # bounded by client_max_size: 413 beyond
    values: dict = {}
    for key, value in form.items():
        if key in ("source_audio", "audio", "prompt_audio"):
            values[key] = value.file.read() if isinstance(value, web.FileField) else str(value).encode()
        elif isinstance(value, web.FileField):
            values[key] = value.file.read().decode("utf-8", "replace")
        else:
            values[key] = value
    return values


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/vc", vc)
