"""/v1/voices: register (through Triton's `register_voice`), list, show, delete (the store directly). A voice
belongs to the key that registered it; another key's voice is never seen, used, listed or deleted (404, as for
an id nobody uses). A registration is parsed once into a `VoiceRegistration` (route_requests.py); its recording is
decoded once here (for the idempotency check's hash) and sent as samples. The routes: docs/api/http.md; tenants
and shared voices: docs/operations/tenants.md.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

from aiohttp import web

from cosyvoice_triton.errors import AlreadyRegistered, Forbidden, InvalidInput, NotFound, RemoteError
from cosyvoice_triton.preprocess.voice_features import audio_sha256
from cosyvoice_triton.admission import ENCODE_COST
from cosyvoice_triton.messages import SPEECH_TOKENS_PER_SECOND
from cosyvoice_triton.voices.store import VoiceRecord, check_voice_id
from cosyvoice_triton.wire.outputs import parse_register_outputs
from cosyvoice_triton.wire.requests import PromptAudio, RegisterInputs

from .auth import RateLimiter, Tenant, current_tenant
from .default_voice import VOICE_ID as DEFAULT_VOICE_ID
from .errors import error_body, http_status, upstream
from .fields import REGISTER_FIELDS
from .route_requests import json_body, parse_registration
from .state import CONFIG, REGISTRATION_RATE, STORE
from .synthesis import call_model, decode_recording


def voice_json(info, created: bool | None = None) -> dict:
    body = {"id": info.voice_id, "name": info.name, "text": info.text, "audio_sha256": info.audio_sha256,
            "prompt_tokens": info.tokens, "prompt_seconds": info.tokens / SPEECH_TOKENS_PER_SECOND, "created_at": info.created_at,
            "shared": info.shared, "modes": list(info.modes), "families": list(info.families),
            "has_recording": info.has_recording}
    if created is not None:
        body["created"] = created
    return body


async def register(app: web.Application, audio: bytes, text: str, voice_id: str | None = None,
                   name: str | None = None, *, owner: str | None):
    """(VoiceRecord, created) for a registration through Triton, owned by `owner` (None: shared).
    Raises CosyVoiceError / RemoteError."""
    store = app[STORE]
    recording = await decode_recording(PromptAudio(file_bytes=audio), "audio")
    if voice_id is not None:
        try:
            check_voice_id(voice_id, "id")
        except InvalidInput as exc:
            raise InvalidInput(exc.field, exc.problem) from None
    sha = await asyncio.to_thread(audio_sha256, recording.samples, recording.sample_rate)
    stored = await asyncio.to_thread(store.find, sha, text, owner)  # this content, this owner, any id
    if stored is not None and voice_id is not None and voice_id != stored.voice_id:
        raise AlreadyRegistered("id", f"this recording and transcript are already registered as voice "
                                      f"{stored.voice_id!r}; use that id (or register without id), not {voice_id!r}",
                                existing=stored)
    inputs = RegisterInputs(audio=recording, text=text, voice_id=voice_id, name=name, owner=owner)
    outputs = await call_model(app, app[CONFIG].register_model, inputs.tensors(), ENCODE_COST,
                               app[CONFIG].routing.register_timeout_s)
    registered = parse_register_outputs(outputs).voice_id
    created = stored is None
    return await asyncio.to_thread(store.info, registered, owner), created


async def _form(request: web.Request) -> dict:
    """A JSON body (audio: base64), or the multipart fields (audio: the file's bytes, strings for the rest)."""
    if request.content_type == "application/json":
        return await json_body(request)
    if request.content_type != "multipart/form-data":
        raise InvalidInput("body", "send multipart/form-data (audio file + text) or JSON")
    form = await request.post()  # bounded by client_max_size: 413 beyond
    values = {}
    for key in ("audio", "text", "prompt_text", "id", "name", "shared"):
        value = form.get(key)
        if value is None:
            continue
        if key == "audio":
            values[key] = value.file.read() if isinstance(value, web.FileField) else str(value).encode()
        else:
            values[key] = value if isinstance(value, str) else value.file.read().decode("utf-8", "replace")
    return values


async def create_voice(request: web.Request) -> web.Response:
    tenant = current_tenant()
    request.app[REGISTRATION_RATE].take(tenant)
    registration = parse_registration(await _form(request), request.app[CONFIG].limits)
    if registration.shared and not tenant.admin:
        raise Forbidden("shared", "only an admin key may register shared voices")
    owner = None if registration.shared else tenant.owner
    try:
        info, created = await register(request.app, registration.audio, registration.text, registration.voice_id,
                                       registration.name, owner=owner)
    except AlreadyRegistered as exc:
        return web.json_response({**error_body(exc), "id": exc.existing.voice_id}, status=http_status(exc))
    except RemoteError as exc:
        fields = replace(REGISTER_FIELDS, prompt_text=registration.text_field)  # the transcript as it was sent
        raise upstream(exc, fields, unnamed="audio") from None
    return web.json_response(voice_json(info, created), status=201 if created else 200)


async def list_voices(request: web.Request) -> web.Response:
    voices = await asyncio.to_thread(request.app[STORE].list, current_tenant().owner)
    return web.json_response({"voices": [voice_json(v) for v in voices]})


async def get_voice(request: web.Request) -> web.Response:
    return web.json_response(voice_json(await _info(request)))


async def delete_voice(request: web.Request) -> web.Response:
    info = await _info(request)
    check_may_delete(info, current_tenant())
    if not await asyncio.to_thread(request.app[STORE].delete, info.voice_id, info.owner):
        raise NotFound("id", f"no voice {info.voice_id!r} is registered")
    return web.json_response({"id": info.voice_id, "deleted": True})


def check_may_delete(info: VoiceRecord, tenant: Tenant) -> None:
    """A key deletes its own voices; shared ones need an admin key; without keys, any but `default`."""
    if not info.shared:
        return  # found for the caller and owned: its own
    if tenant.admin or (not tenant.keyed and info.voice_id != DEFAULT_VOICE_ID):
        return
    who = "an admin key" if tenant.keyed else "an admin key (the gateway runs without keys)"
    raise Forbidden("id", f"voice {info.voice_id!r} is shared: only {who} may delete it")


def _voice_id(request: web.Request) -> str:
    voice_id = request.match_info["voice_id"]
    try:
        return check_voice_id(voice_id, "id")
    except InvalidInput as exc:
        raise InvalidInput("id", exc.problem) from None


async def _info(request: web.Request) -> VoiceRecord:
    """The voice the path's id names to the caller (its own, else a shared one); else 404."""
    voice_id = _voice_id(request)
    try:
        return await asyncio.to_thread(request.app[STORE].info, voice_id, current_tenant().owner)
    except NotFound:
        raise NotFound("id", f"no voice {voice_id!r} is registered") from None


def registration_rate(limits) -> RateLimiter:
    return RateLimiter(limits.registrations_per_minute, 60.0, limits.registration_burst, "registrations")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/voices", create_voice)
    app.router.add_get("/v1/voices", list_voices)
    app.router.add_get("/v1/voices/{voice_id}", get_voice)
    app.router.add_delete("/v1/voices/{voice_id}", delete_voice)
