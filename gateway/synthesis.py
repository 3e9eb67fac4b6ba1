"""Every API's synthesis after its parse (route_requests.py): settle the voice, price the request, stream it from
the least-loaded server of the request's model family (`family`: what the route resolved from the request's
`model`, `routing.Router.family_for`; None: the default family).

`prepare` (a synthesis) and `prepare_conversion` read the request's voice once: a registered voice from the
store (none given: "default"), or an uploaded recording decoded and checked here, once, for its cost and its
errors, and then sent to the model as samples (`reference_wav` + `reference_sample_rate`), so the model does not
decode it again; a conversion's source recording likewise. `routing_cost` prices the request for the router.
`stream_audio` and `whole_audio` send the wire request (its `tensors()`), and `errors.upstream` names
an error that Triton reports by the called API's fields (`Fields`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace

import numpy as np
from aiohttp import web

from cosyvoice_triton.admission import AdmissionPolicy
from cosyvoice_triton.errors import InvalidInput, NotFound, Overloaded, RemoteError, Unavailable
from cosyvoice_triton.pipeline.voice_conversion import validate_source_audio
from cosyvoice_triton.preprocess.audio import decode_audio, validate_prompt_audio
from cosyvoice_triton.preprocess.ssml import is_ssml, parse_ssml
from cosyvoice_triton.wire.checks import check_one_voice
from cosyvoice_triton.wire.names import TARGET_TEXT
from cosyvoice_triton.wire.official import OFFICIAL_SAMPLE_RATE
from cosyvoice_triton.wire.requests import ConversionInputs, PromptAudio, SynthesisInputs
from cosyvoice_triton.wire.outputs import marks_of, waveform_of
from cosyvoice_triton.voices.prompt_budget import speech_tokens_of
from cosyvoice_triton.voices.store import VoiceRecord, check_voice_id

from . import admission
from .auth import current_tenant, slot_set_aside
from .default_voice import VOICE_ID as DEFAULT_VOICE_ID
from .errors import upstream
from .fields import Fields
from .state import CONFIG, COSTS, DEFAULT_VOICE, METRICS, ROUTER, STORE

log = logging.getLogger(__name__)

WireRequest = SynthesisInputs | ConversionInputs  # the wire requests the gateway sends (wire/requests.py)


async def prepare(app: web.Application, inputs: SynthesisInputs, fields: Fields, stock_voice: bool = False,
                  ssml_voices: frozenset[str] = frozenset()) -> tuple[SynthesisInputs, int]:
    """A checked synthesis with its voice settled (`settle_voice`), and the voice's prompt speech tokens (its
    cost share); `ssml_voices`: the voices its SSML names (`ssml_voice_ids`), each checked as voice_id is.
    zero_shot needs a transcript: the request's, or the registered voice's."""
    inputs, prompt_tokens, stored_text = await settle_voice(app, inputs, fields, stock_voice)
    await check_ssml_voices(app, ssml_voices, inputs.mode, fields)
    if inputs.mode == "zero_shot" and not (inputs.prompt_text or "").strip():
        if stored_text is None:
            raise InvalidInput(fields.prompt_text, f"is required with {fields.audio} in zero_shot mode "
                                                   "(the transcript of the prompt recording)")
        if not stored_text.strip():
            raise InvalidInput(fields.prompt_text, f"is required in zero_shot mode: voice {inputs.voice_id!r} was "
                                                   "registered without a transcript")
    return inputs, prompt_tokens


def ssml_voice_ids(inputs: SynthesisInputs, fields: Fields) -> frozenset[str]:
    """The voices an SSML text names in <voice name> (none for plain text or a session's settings); bad SSML is a
    400 naming the text field. The gateway's one read of a text's SSML, before admission."""
    if not inputs.text or inputs.bistream or not is_ssml(inputs.text, inputs.text_type):
        return frozenset()
    with fields.named():
        parts = parse_ssml(inputs.text, TARGET_TEXT)
    return frozenset(part.voice_id for part in parts if getattr(part, "voice_id", None) is not None)


async def check_ssml_voices(app: web.Application, voice_ids: frozenset[str], mode: str, fields: Fields) -> None:
    """Every <voice name> of an SSML text exists and the key may use it (`voice_info`: another key's voice is a
    404, as for voice_id), and has the transcript zero_shot needs."""
    for voice_id in sorted(voice_ids):
        info = await voice_info(app, voice_id, fields.text)
        if mode == "zero_shot" and not info.text.strip():
            raise InvalidInput(fields.text, f"SSML <voice name={voice_id!r}>: the voice was registered without a "
                                            "transcript, which zero_shot mode needs")


async def prepare_conversion(app: web.Application, inputs: ConversionInputs,
                             fields: Fields) -> tuple[ConversionInputs, int]:
    """A checked conversion with its source decoded and checked and its voice settled, and the voice's prompt
    speech tokens."""
    inputs = replace(inputs, source=await decode_recording(inputs.source, fields.source, validate_source_audio))
    inputs, prompt_tokens, _ = await settle_voice(app, inputs, fields)
    return inputs, prompt_tokens


async def conversion_in_voice(base: SynthesisInputs, source: PromptAudio, fields: Fields) -> ConversionInputs:
    """A recording to speak again in a prepared synthesis's voice, seed and speed (a WebSocket vc message)."""
    source = await decode_recording(source, fields.source, validate_source_audio)
    return ConversionInputs(source=source, voice_id=base.voice_id, audio=base.audio, owner=base.owner, seed=base.seed,
                            speed=base.speed)


async def settle_voice(app: web.Application, inputs: WireRequest, fields: Fields,
                       stock_voice: bool = False) -> tuple[WireRequest, int, str | None]:
    """(`inputs` with its voice settled, the voice's prompt speech tokens, a registered voice's transcript or
    None for a recording). A request names its voice by an id or by a prompt recording, not both; neither:
    "default". `stock_voice`: the id is an OpenAI voice name, which speaks as "default" when unregistered.
    The request goes with its tenant's owner tag, so Triton looks its voice ids (SSML's <voice name> too) up in
    the tenant's id space, as `voice_info` does here."""
    check_one_voice(inputs.voice_id, inputs.audio, fields.voice_id, fields.audio, required=False)
    inputs = replace(inputs, owner=current_tenant().owner)
    if inputs.audio is not None:
        audio = await decode_recording(inputs.audio, fields.audio)
        return replace(inputs, audio=audio), speech_tokens(audio), None
    voice_id = DEFAULT_VOICE_ID if inputs.voice_id is None else inputs.voice_id
    info = await voice_info(app, voice_id, fields.voice_id, stock_voice)
    return replace(inputs, voice_id=info.voice_id), info.tokens, info.text


async def decode_recording(audio: PromptAudio, field: str,
                           check: Callable[[np.ndarray, int, str], None] = validate_prompt_audio) -> PromptAudio:
    """A recording sent as a file, decoded and checked (`check`; errors name the API's `field`), as the samples
    that go to the model; one given as samples is returned as it is."""
    if audio.file_bytes is None:
        return audio

    def decode() -> tuple[np.ndarray, int]:
        samples, rate = decode_audio(audio.file_bytes, field)
        check(samples, rate, field)
        return samples, rate

    try:
        samples, rate = await asyncio.to_thread(decode)
    except InvalidInput as exc:
        raise InvalidInput(field, exc.problem) from None
    return PromptAudio(samples=samples, sample_rate=rate)


def speech_tokens(audio: PromptAudio) -> int:
    """A decoded recording's length in speech tokens (25 per second)."""
    return speech_tokens_of(audio.samples.shape[0], audio.sample_rate)


def routing_cost(app: web.Application, inputs: WireRequest, prompt_tokens: int) -> float:
    """The request's cost for the router (routing.py): its text, its voice's prompt tokens and whether a
    recording is encoded; a conversion has no text, and its source is encoded too."""
    if isinstance(inputs, ConversionInputs):
        return app[COSTS].estimate("", prompt_tokens + speech_tokens(inputs.source), True)
    return app[COSTS].estimate(inputs.text, prompt_tokens, inputs.audio is not None)


def synthesis_cost(app: web.Application, text: str, prompt_samples: int) -> float:
    """A synthesis's routing cost from its text and its prompt recording's samples at the official 16 kHz (0: a
    stored voice): the official-form requests (triton_facade.py, routes_kserve.py), whose tensors are not parsed."""
    return app[COSTS].estimate(text, speech_tokens_of(max(0, prompt_samples), OFFICIAL_SAMPLE_RATE),
                               prompt_samples > 0)


async def voice_info(app: web.Application, voice_id: object, field: str, stock_voice: bool = False) -> VoiceRecord:
    """The voice `voice_id` names to the request's tenant (`auth.current_tenant`, set for every request): its own
    voice of that id, else a shared one. Each key has its own ids, so another key's voice is not even looked at:
    404 exactly as for an id nobody uses. Every synthesis route (HTTP, WebSocket, OpenAI, official) resolves its
    voice here before Triton sees the request."""
    try:
        check_voice_id(voice_id, field)
    except InvalidInput as exc:
        raise InvalidInput(field, exc.problem) from None
    try:
        return await asyncio.to_thread(app[STORE].info, voice_id, current_tenant().owner)
    except NotFound:
        if stock_voice:  # an OpenAI voice name that nobody registered
            return await voice_info(app, DEFAULT_VOICE_ID, field)
    if voice_id == DEFAULT_VOICE_ID and app[DEFAULT_VOICE].pending:
        raise Unavailable("the default voice is being registered; try again in a moment")
    raise NotFound(field, f"no voice {voice_id!r} is registered (see GET /v1/voices)")


async def pick_admitted(app: web.Application, tried: list, streamed: bool = True, family: str | None = None) -> object:
    """The least-loaded healthy server (of `family`; None: of any) not tried yet, if admission
    (gateway/admission.py) expects it to start a new request within the queue-wait limit (`streamed`: in real-time
    units too); else Overloaded (503 + Retry-After), counted."""
    router = app[ROUTER]
    server = router.pick(exclude=tried, family=family)
    try:
        with slot_set_aside():
            await admission.check_fresh(AdmissionPolicy(app[CONFIG].routing.max_queue_wait_s), router, server,
                                        router.mean_cost, streamed)
    except Overloaded:
        app[METRICS].refused.labels("gateway").inc()
        raise
    return server


def refused_by_server(app: web.Application, exc: RemoteError) -> None:
    if exc.code == "unavailable":  # the server's admission refused it
        app[METRICS].refused.labels("server").inc()


async def stream_audio(app: web.Application, inputs: WireRequest, cost: float, fields: Fields,
                       request_id: str, family: str | None = None) -> AsyncIterator[np.ndarray | dict]:
    """The request's float32 24 kHz chunks from the least-loaded healthy server of `family` (and, a request with
    `marks`, its speech mark events, dicts, each before the audio it describes), as `on_servers` finds one. A
    failure ends the stream (raised as the gateway's answer, `errors.upstream`)."""
    config, attempts = app[CONFIG], itertools.count(1)
    family = family or app[ROUTER].family_for(None)
    model = app[ROUTER].models[family][0]

    def call(server) -> AsyncIterator[np.ndarray | dict]:
        return server.client.stream(model, inputs.tensors(), f"{request_id}-{next(attempts)}",
                                    first_timeout_s=config.routing.first_chunk_timeout_s,
                                    chunk_timeout_s=config.routing.chunk_timeout_s)

    chunks = on_servers(app, cost, call, admit=True, streamed=True, family=family)
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except RemoteError as exc:
        refused_by_server(app, exc)
        raise upstream(exc, fields) from None


async def whole_audio(app: web.Application, inputs: WireRequest, cost: float, fields: Fields,
                      request_id: str, family: str | None = None) -> np.ndarray:
    """The request's whole float32 24 kHz waveform from `family`'s offline model (`cosyvoice2_offline`: each
    sentence's tokens in one full-attention flow pass, as the official non-streamed path), retried elsewhere on
    transport errors. Raises a CosyVoiceError."""
    return (await whole_answer(app, inputs, cost, fields, request_id, family))[0]


async def whole_answer(app: web.Application, inputs: WireRequest, cost: float, fields: Fields,
                       request_id: str, family: str | None = None) -> tuple[np.ndarray, list[dict]]:
    """`whole_audio` and the request's complete speech marks ([] unless it asked for them)."""
    model = app[ROUTER].models[family or app[ROUTER].family_for(None)][1]
    try:
        outputs = await call_model(app, model, inputs.tensors(), cost, app[CONFIG].routing.offline_timeout_s,
                                   request_id, admit=True)
    except RemoteError as exc:
        refused_by_server(app, exc)
        raise upstream(exc, fields) from None
    return waveform_of(outputs), marks_of(outputs)


async def call_model(app: web.Application, model: str, inputs: dict[str, np.ndarray], cost: float,
                     timeout_s: float, request_id: str = "", admit: bool = False) -> dict[str, np.ndarray]:
    """A unary call (register_voice, cosyvoice2_offline) on the least-loaded server of the family whose model it is
    (any server for a model of every family, e.g. register_voice), retried elsewhere on transport errors. `admit`:
    a synthesis, refused (Overloaded) when no server would start it in time."""
    return await routed(app, cost, lambda server: server.client.infer(model, inputs, timeout_s, request_id), admit,
                        family=app[ROUTER].model_family(model))


async def routed(app: web.Application, cost: float, send: Callable[[object], Awaitable], admit: bool = False,
                 server: object | None = None, family: str | None = None):
    """`await send(server)` where `on_servers` sends it (a unary call; `admit`: a synthesis; `family`: a server of
    that family, e.g. `Router.model_family` of the model called; None: any)."""
    async def once(chosen) -> AsyncIterator:
        yield await send(chosen)

    answers = on_servers(app, cost, once, admit=admit, server=server, family=family)
    async with aclosing(answers):
        async for answer in answers:
            return answer


async def on_servers(app: web.Application, cost: float, call: Callable[[object], AsyncIterator], *, admit: bool,
                     streamed: bool = False, server: object | None = None, family: str | None = None) -> AsyncIterator:
    """What `call(server)` yields, from `server`, else from the least-loaded healthy server of `family` (None: of
    any; `admit`: a synthesis, refused with Overloaded when none would start it in time; `streamed`: admitted in
    real-time units), counted against it while it runs. A retryable RemoteError before the first item is tried once
    more on another server of that family (not with a given `server`); after it, or with no server left to try, it
    is raised. The gateway's one retry loop."""
    router, metrics, routing = app[ROUTER], app[METRICS], app[CONFIG].routing
    tried = []
    while True:
        chosen = server or (await pick_admitted(app, tried, streamed, family) if admit
                            else router.pick(exclude=tried, family=family))
        tried.append(chosen)
        metrics.routed.labels(chosen.name).inc()
        produced = False
        with router.lease(chosen, cost):
            try:
                items = call(chosen)
                async with aclosing(items):
                    async for item in items:
                        produced = True
                        yield item
                return
            except RemoteError as exc:
                metrics.errors.labels(f"triton_{exc.code}").inc()
                if exc.code == "unreachable":
                    router.set_health(chosen, False, exc.message)
                others = [b for b in router.healthy(family) if b not in tried]
                if produced or server is not None or not exc.retryable or len(tried) >= routing.max_attempts \
                        or not others:
                    raise
                metrics.retries.inc()
                log.warning("a call to %s failed before its first answer (%s); retrying on another server",
                            chosen.name, exc.message)
