"""/v1/voices: register (through Triton's `register_voice`), list, show, delete (the store directly).

POST /v1/voices     multipart/form-data: audio (a WAV/FLAC/OGG file), text (its transcript),
                    id (optional), name (optional); or JSON {"audio": base64, "text", "id", "name"}.
                    201 with the voice when it is new, 200 when this recording and transcript were
                    registered already (registration is idempotent by audio hash and transcript).
GET /v1/voices      {"voices": [...]}
GET /v1/voices/{id} the voice; 404 if unknown
DELETE /v1/voices/{id}  {"id", "deleted": true}; 404 if unknown
"""
from __future__ import annotations

import asyncio

import numpy as np
from aiohttp import web

from cosyvoice_triton.errors import InvalidInput, NotFound
from cosyvoice_triton.frontend.audio import load_prompt_audio
from cosyvoice_triton.frontend.voice_features import audio_sha256
from cosyvoice_triton.runtime.voice_store import check_voice_id

from .errors import BadRequest, PayloadTooLarge, VoiceNotFound
from .routing import ENCODE_COST
from .state import CONFIG, STORE
from .synthesis import Fields, call_model, decode_base64, gateway_error, optional_string, string_array
from .triton_client import TritonCallError

REGISTER_FIELDS = Fields(text="text", voice="id", prompt_audio="audio", prompt_text="text")
_REGISTER_INPUTS = {"reference_audio": "audio", "reference_wav": "audio", "reference_text": "text",
                    "voice_id": "id", "name": "name"}


def voice_json(info, created: bool | None = None) -> dict:
    body = {"id": info.voice_id, "name": info.name, "text": info.text, "audio_sha256": info.audio_sha256,
            "prompt_tokens": info.tokens, "prompt_seconds": info.tokens / 25.0, "created_at": info.created_at}
    if created is not None:
        body["created"] = created
    return body


async def register(app: web.Application, audio: bytes, text: str, voice_id: str | None = None,
                   name: str | None = None):
    """(VoiceInfo, created) for a registration through Triton. Raises GatewayError / TritonCallError."""
    store = app[STORE]
    try:
        samples, rate = await asyncio.to_thread(load_prompt_audio, audio, "audio")
        if voice_id is not None:
            check_voice_id(voice_id, "id")
    except InvalidInput as exc:
        raise BadRequest(exc.field, exc.problem) from None
    sha = await asyncio.to_thread(audio_sha256, samples, rate)
    stored = await asyncio.to_thread(store.find, sha, text)  # this recording and transcript, under any id
    inputs = {"reference_audio": np.array([audio], dtype=object), "reference_text": string_array(text)}
    if voice_id is not None:
        inputs["voice_id"] = string_array(voice_id)
    if name is not None:
        inputs["name"] = string_array(name)
    outputs = await call_model(app, app[CONFIG].register_model, inputs, ENCODE_COST,
                               app[CONFIG].routing.register_timeout_s)
    registered = outputs["voice_id"].reshape(-1)[0].decode("utf-8")
    created = stored is None
    return await asyncio.to_thread(store.info, registered), created


async def _form(request: web.Request) -> dict:
    if request.content_type == "application/json":
        body = await request.json()
        if not isinstance(body, dict):
            raise BadRequest("body", "must be a JSON object")
        body = dict(body)
        body["audio"] = decode_base64(body.get("audio"), "audio", request.app[CONFIG].limits.max_upload_bytes)
        return body
    if request.content_type != "multipart/form-data":
        raise BadRequest("body", "send multipart/form-data (audio file + text) or JSON")
    form = await request.post()  # bounded by client_max_size: 413 beyond
    values = {}
    for key in ("audio", "text", "prompt_text", "id", "name"):
        value = form.get(key)
        if value is None:
            continue
        if key == "audio":
            values[key] = value.file.read() if isinstance(value, web.FileField) else str(value).encode()
        else:
            values[key] = value if isinstance(value, str) else value.file.read().decode("utf-8", "replace")
    return values


async def create_voice(request: web.Request) -> web.Response:
    values = await _form(request)
    audio = values.get("audio")
    if not audio:
        raise BadRequest("audio", "is required: the prompt recording (WAV, FLAC or OGG)")
    limit = request.app[CONFIG].limits.max_upload_bytes
    if len(audio) > limit:
        raise PayloadTooLarge(f"audio: {len(audio)} bytes is more than the limit of {limit}", "audio")
    text = optional_string(values.get("text", values.get("prompt_text", "")), "text") or ""
    voice_id = optional_string(values.get("id"), "id") or None
    name = optional_string(values.get("name"), "name") or None
    try:
        info, created = await register(request.app, audio, text, voice_id, name)
    except TritonCallError as exc:
        if exc.kind == "invalid":
            raise BadRequest(_REGISTER_INPUTS.get(exc.field, exc.field or "audio"), exc.problem) from None
        raise gateway_error(exc, REGISTER_FIELDS) from None
    return web.json_response(voice_json(info, created), status=201 if created else 200)


async def list_voices(request: web.Request) -> web.Response:
    voices = await asyncio.to_thread(request.app[STORE].list)
    return web.json_response({"voices": [voice_json(v) for v in voices]})


async def get_voice(request: web.Request) -> web.Response:
    return web.json_response(voice_json(await _info(request)))


async def delete_voice(request: web.Request) -> web.Response:
    voice_id = _voice_id(request)
    if not await asyncio.to_thread(request.app[STORE].delete, voice_id):
        raise VoiceNotFound("id", f"no voice {voice_id!r} is registered")
    return web.json_response({"id": voice_id, "deleted": True})


def _voice_id(request: web.Request) -> str:
    voice_id = request.match_info["voice_id"]
    try:
        return check_voice_id(voice_id, "id")
    except InvalidInput as exc:
        raise BadRequest("id", exc.problem) from None


async def _info(request: web.Request):
    voice_id = _voice_id(request)
    try:
        return await asyncio.to_thread(request.app[STORE].info, voice_id)
    except NotFound:
        raise VoiceNotFound("id", f"no voice {voice_id!r} is registered") from None


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/voices", create_voice)
    app.router.add_get("/v1/voices", list_voices)
    app.router.add_get("/v1/voices/{voice_id}", get_voice)
    app.router.add_delete("/v1/voices/{voice_id}", delete_voice)
