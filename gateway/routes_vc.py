"""POST /v1/vc: voice conversion (the official inference_vc), a source recording spoken again in a voice. The form
is parsed once into a `VcRequest` (route_requests.py); the gateway decodes both recordings once and sends their
samples. Its fields: docs/api/http.md#request-fields.
"""
from __future__ import annotations

from aiohttp import web

from cosyvoice_triton.errors import InvalidInput

from .audio_response import send_audio
from .auth import limit_key
from .route_requests import parse_vc
from .state import CONFIG, LIMITER, ROUTER
from .synthesis import prepare_conversion, routing_cost


async def vc(request: web.Request) -> web.StreamResponse:
    app = request.app
    vc = parse_vc(await _form(request), app[CONFIG].limits)
    family = app[ROUTER].family_for(vc.model)
    inputs, prompt_tokens = await prepare_conversion(app, vc.inputs, vc.fields)  # /v1/tts's names, and source_audio
    with app[LIMITER].slot(limit_key(request)):
        return await send_audio(request, inputs, routing_cost(app, inputs, prompt_tokens), vc.fields, vc.format,
                                vc.stream, route="vc", family=family)


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
