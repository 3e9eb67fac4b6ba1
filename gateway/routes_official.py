"""The official CosyVoice FastAPI server's routes (`/inference_*`) on the gateway's port, so that its client
works unchanged; official_api.py says what each request becomes. Each goes through `synthesis.prepare` and
`audio_response.send_audio` as /v1/tts does (keys, limits, admission, metrics, access log). The fields, the
answer and the errors: docs/api/official.md#the-official-fastapi-routes.
"""
from __future__ import annotations

from aiohttp import web

from cosyvoice_triton.errors import InvalidInput

from .audio_response import send_audio
from .auth import limit_key
from .official_api import HTTP_FIELDS, KINDS, PCM, Kind, official_request, prepare_official
from .state import CONFIG, LIMITER
from .synthesis import routing_cost

FORM_TYPES = frozenset({"multipart/form-data", "application/x-www-form-urlencoded"})


def inference(kind: Kind):
    """The handler of /inference_<kind>."""

    async def handler(request: web.Request) -> web.StreamResponse:
        app = request.app
        official = official_request(kind, await form_fields(request), HTTP_FIELDS, app[CONFIG].limits)
        inputs, prompt_tokens = await prepare_official(app, official, HTTP_FIELDS)
        with app[LIMITER].slot(limit_key(request)):
            return await send_audio(request, inputs, routing_cost(app, inputs, prompt_tokens), HTTP_FIELDS, PCM,
                                    stream=True, route="official")

    return handler


async def form_fields(request: web.Request) -> dict[str, object]:
    """The body's form fields: a file's bytes, strings for the rest. aiohttp reads a form only from a POST
    (and the like), so a GET's body is read through its POST clone."""
    if request.content_type not in FORM_TYPES:
        if request.body_exists:
            raise InvalidInput("body", "send the fields as a form: multipart/form-data (needed for prompt_wav) or "
                                       "application/x-www-form-urlencoded")
        return {}
    form = await (request if request.method == "POST" else request.clone(method="POST")).post()  # client_max_size
    return {key: value.file.read() if isinstance(value, web.FileField) else value for key, value in form.items()}


def add_routes(app: web.Application) -> None:
    for kind in KINDS.values():
        handler = inference(kind)
        app.router.add_get(f"/inference_{kind.name}", handler, allow_head=False)
        app.router.add_post(f"/inference_{kind.name}", handler)
