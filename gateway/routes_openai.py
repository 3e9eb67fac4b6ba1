"""POST /v1/audio/speech: the OpenAI text-to-speech API, so OpenAI SDKs and tools work unchanged. The body is
parsed once into a `SpeechRequest` (route_requests.py); its fields and extensions: docs/api/openai.md.
"""
from __future__ import annotations

from aiohttp import web

from cosyvoice_triton import __version__

from .audio_response import AUDIO_BYTES, AudioEvents, send_audio
from .auth import limit_key
from .fields import OPENAI_FIELDS
from .route_requests import json_body, parse_speech
from .state import CONFIG, COSTS, LIMITER, ROUTER
from .synthesis import prepare, routing_cost


async def speech(request: web.Request) -> web.StreamResponse:
    app = request.app
    speech = parse_speech(await json_body(request), app[CONFIG].limits)
    family = app[ROUTER].family_for(speech.model, any_name=True)  # tts-1 and the like: the default family
    inputs, prompt_tokens = await prepare(app, speech.inputs, OPENAI_FIELDS, speech.stock_voice, speech.ssml_voices)
    body = AudioEvents(app[COSTS].text_tokens(inputs.text), inputs.marks) if speech.events else AUDIO_BYTES
    with app[LIMITER].slot(limit_key(request)):
        return await send_audio(request, inputs, routing_cost(app, inputs, prompt_tokens), OPENAI_FIELDS,
                                speech.format, speech.stream or speech.events, route="openai", body=body,
                                family=family)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: OpenAI's model list: each model family the servers serve (the default family before any
    server has answered a health check), and the version of this service (`version`, also on /readyz). `model`
    names one of them; any other name speaks with the default family."""
    router = request.app[ROUTER]
    data = [{"id": family, "object": "model", "created": 0, "owned_by": "cosyvoice-triton", "version": __version__}
            for family in router.families or [router.family]]
    return web.json_response({"object": "list", "data": data, "version": __version__})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_get("/v1/models", models)
