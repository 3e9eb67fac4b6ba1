"""POST /v1/tts: text -> 24 kHz audio, whole or streamed. The body is parsed once into a `TtsRequest`
(route_requests.py) and answered by audio_response.py; this route never checks a field itself. Its fields and
answers: docs/api/http.md#request-fields.
"""
from __future__ import annotations

from aiohttp import web

from .audio_response import AUDIO_BYTES, AudioEvents, send_audio
from .auth import limit_key
from .fields import TTS_FIELDS
from .route_requests import json_body, parse_tts
from .state import CONFIG, COSTS, LIMITER, ROUTER
from .synthesis import prepare, routing_cost


async def tts(request: web.Request) -> web.StreamResponse:
    app = request.app
    tts = parse_tts(await json_body(request), app[CONFIG].limits)
    family = app[ROUTER].family_for(tts.model)
    inputs, prompt_tokens = await prepare(app, tts.inputs, TTS_FIELDS, ssml_voices=tts.ssml_voices)
    marked = tts.stream and inputs.marks  # speech marks streamed: server-sent events among the audio
    body = AudioEvents(app[COSTS].text_tokens(inputs.text), marks=True) if marked else AUDIO_BYTES
    with app[LIMITER].slot(limit_key(request)):
        return await send_audio(request, inputs, routing_cost(app, inputs, prompt_tokens), TTS_FIELDS, tts.format,
                                tts.stream, route="tts", body=body, family=family)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/tts", tts)
