"""One synthesis request, shared by every API: check it, price it, stream it from the least-loaded server.

The checks happen here, before Triton sees the request, so errors name the field of the API that was
called (`Fields`: `text` for /v1/tts, `input` for the OpenAI route, ...). Errors Triton still reports
are mapped back to the same names. A request without a seed gets one here, so a retry on another
server gives the same audio.

The chunk-policy overrides (`chunk_first_hop`, `chunk_hop_scale`, `chunk_max_hop`, `chunk_policy`; /v1/tts
and the WebSocket start message) are checked with the library's `ChunkPolicy` against its defaults, and sent to
the model only when given (the model checks them again against its own policy).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

import numpy as np
from aiohttp import web

from cosyvoice_triton.admission import AdmissionPolicy, retry_after_from_message
from cosyvoice_triton.errors import InvalidInput, NotFound
from cosyvoice_triton.preprocess.audio import load_prompt_audio
from cosyvoice_triton.preprocess.text import text_problem, validate_text
from cosyvoice_triton.pipeline.chunk_policy import ChunkPolicy
from cosyvoice_triton.messages import MODES, SEED_LIMIT, check_speed
from cosyvoice_triton.voices.store import check_voice_id, visible_to
from cosyvoice_triton.triton.contracts import synthesis_inputs

from . import admission
from .auth import current_tenant
from .default_voice import VOICE_ID as DEFAULT_VOICE_ID
from .errors import (
    BadRequest,
    GatewayError,
    Overloaded,
    PayloadTooLarge,
    ServiceUnavailable,
    UpstreamError,
    UpstreamTimeout,
    VoiceNotFound,
)
from .routing import TOKENS_PER_SECOND
from .state import CONFIG, COSTS, DEFAULT_VOICE, METRICS, ROUTER, STORE
from .triton_channel import TritonCallError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fields:
    """Request field names of one API, for error messages."""

    text: str = "text"
    voice: str = "voice_id"
    prompt_audio: str = "prompt_audio"
    prompt_text: str = "prompt_text"
    mode: str = "mode"
    instruct: str = "instruct"
    seed: str = "seed"
    chunk_first_hop: str = "chunk_first_hop"
    chunk_hop_scale: str = "chunk_hop_scale"
    chunk_max_hop: str = "chunk_max_hop"
    chunk_policy: str = "chunk_policy"

    def of_model_input(self, name: str | None) -> str | None:
        """The API field behind a cosyvoice2 input named in a Triton error."""
        return {"target_text": self.text, "reference_audio_id": self.voice, "reference_audio": self.prompt_audio,
                "reference_wav": self.prompt_audio, "reference_sample_rate": self.prompt_audio,
                "reference_text": self.prompt_text, "instruct_text": self.instruct, "mode": self.mode,
                "seed": self.seed, "chunk_first_hop": self.chunk_first_hop,
                "chunk_hop_scale": self.chunk_hop_scale, "chunk_max_hop": self.chunk_max_hop,
                "chunk_policy": self.chunk_policy}.get(name or "", name)


TTS_FIELDS = Fields()
OPENAI_FIELDS = Fields(text="input", voice="voice", instruct="instructions")
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Synthesis:
    text: str
    mode: str
    seed: int
    voice_id: str | None
    prompt_audio: bytes | None  # an audio file's bytes
    prompt_text: str | None
    instruct: str
    prompt_tokens: int  # of the voice: its cost share
    cost: float
    fields: Fields
    chunk_first_hop: int | None = None  # chunk-policy overrides; None: the server's policy
    chunk_hop_scale: float | None = None
    chunk_max_hop: int | None = None
    text_frontend: bool | None = None  # False: the text as given: no normalization, no sentence splitting; None: the default (true)
    chunk_policy: str | None = None  # fixed | adaptive; None: the server's
    speed: float | None = None  # speaking speed (messages.check_speed); None: 1.0

    def inputs(self, seed: int | None = None) -> dict[str, np.ndarray]:
        """The cosyvoice2 request (contracts.py), with `seed` instead of the request's when given."""
        return synthesis_inputs(self.text, voice_id=self.voice_id, audio_file=self.prompt_audio,
                                prompt_text=self.prompt_text, mode=self.mode, instruct_text=self.instruct or None,
                                seed=self.seed if seed is None else seed, chunk_first_hop=self.chunk_first_hop,
                                chunk_hop_scale=self.chunk_hop_scale, chunk_max_hop=self.chunk_max_hop, text_frontend=self.text_frontend,
                                chunk_policy=self.chunk_policy, speed=self.speed)

    def with_text(self, text: str, seed: int, cost: float) -> Synthesis:
        """The same voice and settings (chunk policy included) for another text (WebSocket segments)."""
        return replace(self, text=text, seed=seed, cost=cost)


def decode_base64(value: object, field: str, max_bytes: int) -> bytes:
    if not isinstance(value, str):
        raise BadRequest(field, "must be a base64 string of an audio file (WAV, FLAC or OGG)")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(field, "is not valid base64") from None
    if len(data) > max_bytes:
        raise PayloadTooLarge.upload(field, len(data), max_bytes, field)
    return data


def check_seed(seed: object, field: str) -> int:
    if seed is None:
        return secrets.randbelow(SEED_LIMIT)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise BadRequest(field, f"must be an integer from 0 to {SEED_LIMIT - 1}")
    return seed


def optional_string(value: object, field: str) -> str | None:
    """`value` if it is None or a string without control characters or lone surrogates."""
    if value is not None and not isinstance(value, str):
        raise BadRequest(field, f"must be a string, got {type(value).__name__}")
    problem = text_problem(value) if value else None
    if problem:
        raise BadRequest(field, problem)
    return value


def optional_int32(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(field, f"must be an integer, got {type(value).__name__}")
    if value > INT32_MAX:  # the model input is INT32; ChunkPolicy checks the lower bounds
        raise BadRequest(field, f"must be at most {INT32_MAX}, got {value}")
    return value


def optional_number(value: object, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(field, f"must be a number, got {type(value).__name__}")
    return float(value)


def check_chunk_policy(first_hop: object, hop_scale: object, max_hop: object, fields: Fields,
                       kind: object = None) -> dict[str, int | float | str | None]:
    """The overrides checked as the model will check them: types here, ranges by `ChunkPolicy` (its errors
    name the model input, chunk_*, mapped to the API's field). Returns them as `Synthesis` fields."""
    first_hop = optional_int32(first_hop, fields.chunk_first_hop)
    hop_scale = optional_number(hop_scale, fields.chunk_hop_scale)
    max_hop = optional_int32(max_hop, fields.chunk_max_hop)
    kind = optional_string(kind, fields.chunk_policy)
    try:
        ChunkPolicy().with_overrides(first_hop=first_hop, hop_scale=hop_scale, max_hop=max_hop, kind=kind)
    except InvalidInput as exc:
        raise BadRequest(fields.of_model_input(exc.field), exc.problem) from None
    return {"chunk_first_hop": first_hop, "chunk_hop_scale": hop_scale, "chunk_max_hop": max_hop,
            "chunk_policy": kind}


async def prepare(app: web.Application, *, text: object, voice_id: object = None, prompt_audio: bytes | None = None,
                  prompt_text: object = None, mode: object = "zero_shot", instruct: object = None,
                  seed: object = None, chunk_first_hop: object = None, chunk_hop_scale: object = None,
                  chunk_max_hop: object = None, chunk_policy: object = None, text_frontend: object = None,
                  speed: object = None, fields: Fields = TTS_FIELDS,
                  check_text: bool = True) -> Synthesis:
    """Check a request and resolve its voice (no voice given: "default"). `check_text` False: settings
    for texts that come later (a WebSocket start message)."""
    if not check_text:
        text = ""
    else:
        try:
            text = validate_text(text, fields.text, app[CONFIG].limits.max_text_chars)
        except InvalidInput as exc:
            raise BadRequest(fields.text, exc.problem) from None
    mode = "zero_shot" if mode is None else mode
    if mode not in MODES:
        raise BadRequest(fields.mode, f"must be one of {', '.join(MODES)}, got {mode!r}")
    instruct = optional_string(instruct, fields.instruct) or ""
    if mode == "instruct2" and not instruct.strip():
        raise BadRequest(fields.instruct, "is required in instruct2 mode")
    prompt_text = optional_string(prompt_text, fields.prompt_text)
    seed = check_seed(seed, fields.seed)
    if text_frontend is not None and not isinstance(text_frontend, bool):
        raise BadRequest("text_frontend", "must be true or false")
    if speed is not None:
        try:
            speed = float(check_speed(speed))
        except InvalidInput as exc:
            raise BadRequest("speed", exc.problem) from None
    chunk = check_chunk_policy(chunk_first_hop, chunk_hop_scale, chunk_max_hop, fields, chunk_policy)
    prompt_tokens = await prompt_audio_tokens(voice_id, prompt_audio, fields)
    if prompt_tokens is not None:
        if mode == "zero_shot" and not (prompt_text or "").strip():
            raise BadRequest(fields.prompt_text, f"is required with {fields.prompt_audio} in zero_shot mode "
                                                 "(the transcript of the prompt recording)")
    else:
        voice_id = DEFAULT_VOICE_ID if voice_id is None else voice_id
        info = await voice_info(app, voice_id, fields.voice)
        prompt_tokens = info.tokens
        if mode == "zero_shot" and not info.text.strip() and not (prompt_text or "").strip():
            raise BadRequest(fields.prompt_text, f"is required in zero_shot mode: voice {voice_id!r} was "
                                                 "registered without a transcript")
    cost = app[COSTS].estimate(text, prompt_tokens, prompt_audio is not None)
    return Synthesis(text=text, mode=mode, seed=seed, voice_id=voice_id,
                     prompt_audio=prompt_audio, prompt_text=prompt_text, instruct=instruct,
                     prompt_tokens=prompt_tokens, cost=cost, fields=fields, text_frontend=text_frontend,
                     speed=None if speed == 1.0 else speed, **chunk)


async def prompt_audio_tokens(voice_id: object, prompt_audio: bytes | None, fields: Fields) -> int | None:
    """The speech tokens (25 per second) of a request's prompt recording, decoded and checked; None without one.
    A request names its voice by an id or by a prompt recording, not both (/v1/tts, /v1/vc, the WebSocket)."""
    if voice_id is not None and prompt_audio is not None:
        raise BadRequest(fields.voice, f"give {fields.voice} or {fields.prompt_audio}, not both")
    if prompt_audio is None:
        return None
    try:
        samples, rate = await asyncio.to_thread(load_prompt_audio, prompt_audio, fields.prompt_audio)
    except InvalidInput as exc:
        raise BadRequest(fields.prompt_audio, exc.problem) from None
    return int(samples.shape[0] / rate * TOKENS_PER_SECOND)


async def voice_info(app: web.Application, voice_id: object, field: str):
    """The voice if the request's tenant may use it: its own or a shared one (`auth.current_tenant`, set
    for every request). Another key's voice answers 404 exactly as a missing one. Every synthesis route
    (HTTP, WebSocket, OpenAI) resolves its voice here before Triton sees the request."""
    try:
        check_voice_id(voice_id, field)
    except InvalidInput as exc:
        raise BadRequest(field, exc.problem) from None
    try:
        info = await asyncio.to_thread(app[STORE].info, voice_id)
    except NotFound:
        info = None
    if info is not None and visible_to(info, current_tenant().owner):
        return info
    if info is None and voice_id == DEFAULT_VOICE_ID and app[DEFAULT_VOICE].pending:
        raise ServiceUnavailable("the default voice is being registered; try again in a moment")
    raise VoiceNotFound(field, f"no voice {voice_id!r} is registered (see GET /v1/voices)")


def gateway_error(exc: TritonCallError, fields: Fields) -> GatewayError:
    if exc.kind == "invalid":
        return BadRequest(fields.of_model_input(exc.field) or "request", exc.problem)
    if exc.kind == "not_found":
        return VoiceNotFound(fields.voice, exc.problem)
    if exc.kind == "busy":  # the server's admission (or a full queue) refused it
        return Overloaded(exc.message, retry_after_from_message(exc.message))
    if exc.kind in ("unreachable", "cancelled"):
        return ServiceUnavailable(exc.message)
    if exc.kind == "timeout":
        return UpstreamTimeout(exc.message)
    return UpstreamError(exc.message)


def pick_admitted(app: web.Application, tried: list) -> object:
    """The least-loaded healthy server not tried yet, if admission (gateway/admission.py) expects it to start
    a new request within the queue-wait limit; else Overloaded (503 + Retry-After), counted."""
    router = app[ROUTER]
    server = router.pick(exclude=tried)
    try:
        admission.check(AdmissionPolicy(app[CONFIG].routing.max_queue_wait_s), server, router.mean_cost)
    except Overloaded:
        app[METRICS].refused.labels("gateway").inc()
        raise
    return server


def refused_by_server(app: web.Application, exc: TritonCallError) -> None:
    if exc.kind == "busy":
        app[METRICS].refused.labels("server").inc()


async def stream_audio(app: web.Application, synthesis: Synthesis, request_id: str) -> AsyncIterator[np.ndarray]:
    """The request's float32 24 kHz chunks from the least-loaded healthy server. A failure before the first
    chunk is retried on another server; after it, it ends the stream (raised as a GatewayError). A request
    that no server would start in time is refused (Overloaded) before it is sent."""
    router, metrics, routing = app[ROUTER], app[METRICS], app[CONFIG].routing
    tried = []
    while True:
        server = pick_admitted(app, tried)
        tried.append(server)
        metrics.routed.labels(server.name).inc()
        produced = False
        with router.lease(server, synthesis.cost):
            try:
                chunks = server.client.stream(app[CONFIG].synthesis_model, synthesis.inputs(),
                                               f"{request_id}-{len(tried)}",
                                               first_timeout_s=routing.first_chunk_timeout_s,
                                               chunk_timeout_s=routing.chunk_timeout_s)
                async with aclosing(chunks):
                    async for chunk in chunks:
                        produced = True
                        yield chunk
                return
            except TritonCallError as exc:
                metrics.errors.labels(f"triton_{exc.kind}").inc()
                if exc.kind == "unreachable":
                    router.set_health(server, False, exc.message)
                others = [b for b in router.healthy() if b not in tried]
                if produced or not exc.retryable or len(tried) >= routing.max_attempts or not others:
                    refused_by_server(app, exc)
                    raise gateway_error(exc, synthesis.fields) from None
                metrics.retries.inc()
                log.warning("request %s failed on %s before any audio (%s); retrying on another server",
                            request_id, server.name, exc.message)


async def whole_audio(app: web.Application, synthesis: Synthesis, request_id: str) -> np.ndarray:
    """The request's whole float32 24 kHz waveform from the offline model (`cosyvoice2_offline`: each sentence's
    tokens in one full-attention flow pass, as the official non-streamed path), retried elsewhere on transport
    errors. Raises a GatewayError."""
    try:
        outputs = await call_model(app, app[CONFIG].offline_model, synthesis.inputs(), synthesis.cost,
                                   app[CONFIG].routing.offline_timeout_s, request_id, admit=True)
    except TritonCallError as exc:
        refused_by_server(app, exc)
        raise gateway_error(exc, synthesis.fields) from None
    return np.asarray(outputs["waveform"], dtype=np.float32).reshape(-1)


async def call_model(app: web.Application, model: str, inputs: dict[str, np.ndarray], cost: float,
                     timeout_s: float, request_id: str = "", admit: bool = False) -> dict[str, np.ndarray]:
    """A unary call (register_voice, cosyvoice2_offline) on the least-loaded server, retried elsewhere on
    transport errors. `admit`: a synthesis, refused (Overloaded) when no server would start it in time."""
    router, metrics, routing = app[ROUTER], app[METRICS], app[CONFIG].routing
    tried = []
    while True:
        server = pick_admitted(app, tried) if admit else router.pick(exclude=tried)
        tried.append(server)
        metrics.routed.labels(server.name).inc()
        with router.lease(server, cost):
            try:
                return await server.client.infer(model, inputs, timeout_s, request_id)
            except TritonCallError as exc:
                metrics.errors.labels(f"triton_{exc.kind}").inc()
                if exc.kind == "unreachable":
                    router.set_health(server, False, exc.message)
                others = [b for b in router.healthy() if b not in tried]
                if not exc.retryable or len(tried) >= routing.max_attempts or not others:
                    raise
                metrics.retries.inc()
