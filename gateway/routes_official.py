"""The official CosyVoice FastAPI server's routes (runtime/python/fastapi/server.py), on the gateway's port, so
its client (runtime/python/fastapi/client.py) works unchanged:

  GET|POST /inference_sft            tts_text, spk_id
  GET|POST /inference_zero_shot      tts_text, prompt_text, prompt_wav (a file)
  GET|POST /inference_cross_lingual  tts_text, prompt_wav (a file)
  GET|POST /inference_instruct       tts_text, spk_id, instruct_text
  GET|POST /inference_instruct2      tts_text, instruct_text, prompt_wav (a file)

The fields come as a form in the body, multipart/form-data (needed for the file) or urlencoded, with either
method: the official client sends its form in a GET's body. `seed` (a form field) is our extension, as on
/v1/tts. official_api.py says what each request becomes (sft and instruct speak a registered voice spk_id).
The answer is a chunked body of raw 16-bit little-endian PCM at 24 kHz, no header (Content-Type audio/pcm,
with X-Seed and X-Sample-Rate as /v1/tts), each chunk written as it is made. Errors are /v1/tts's JSON, naming
the official field: 400 for a missing or malformed one, 404 for an unknown spk_id, 401 without a valid key
when keys are on, 429 and 503 with Retry-After (limits, admission, draining). Keys, limits, admission,
metrics (route "official") and the access log are those of every route: the request goes through
`synthesis.prepare` and `audio_response.send_audio` as /v1/tts does.
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
