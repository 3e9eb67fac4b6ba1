"""The typed request of each route, parsed once from its body; everything after works on these, never on the body.
What goes to Triton is the wire package's request, checked here once by the library's own checks (their errors name
Triton inputs, and `Fields` names them as each API does); what belongs to JSON and forms (base64, "true"/"false",
unknown keys, formats) is checked here. A request without a seed gets one here (a retry elsewhere gives the same
audio); SSML is read once (`synthesis.ssml_voice_ids`). Where each check runs: docs/architecture/layout.md.
"""
from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from cosyvoice_triton.audio_out import ALIASES, FORMATS, AudioFormat, audio_format
from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import MAX_SPEED, MIN_SPEED, SEED_LIMIT
from cosyvoice_triton.wire.requests import ConversionInputs, PromptAudio, SynthesisInputs, chunk_overrides
from cosyvoice_triton.wire.checks import check_optional_text
from cosyvoice_triton.voices.store import short_repr

from .config import Limits
from .errors import too_large_upload
from .fields import OPENAI_FIELDS, SOURCE_ALIASES, TTS_FIELDS, Fields, resolve_aliases
from .synthesis import ssml_voice_ids

TTS_FORMATS = (*FORMATS, *ALIASES)  # the formats of /v1/tts, /v1/vc and the WebSocket
TTS_KEYS = frozenset({"text", "voice_id", "voice", "prompt_audio", "prompt_text", "mode", "instruct", "seed",
                      "chunk_first_hop", "chunk_hop_scale", "chunk_max_hop", "chunk_policy", "text_frontend", "speed",
                      "text_type", "marks", "format", "stream", "model"})
START_KEYS = (TTS_KEYS - {"stream"}) | {"type", "text_mode"}
VC_KEYS = frozenset({"source_audio", "audio", "voice_id", "prompt_audio", "seed", "speed", "format", "stream",
                     "model"})
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
                           "verse", "marin", "cedar"})
OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")  # OpenAI's response_format values


@dataclass(frozen=True)
class TtsRequest:
    inputs: SynthesisInputs  # checked; the voice not yet resolved
    format: AudioFormat
    stream: bool
    ssml_voices: frozenset[str] = frozenset()  # the voices its SSML names (synthesis.ssml_voice_ids)
    model: str | None = None  # the model family it names (routing.Router.family_for); None: the default


@dataclass(frozen=True)
class SpeechRequest:
    inputs: SynthesisInputs  # checked; the voice not yet resolved
    format: AudioFormat
    stream: bool
    events: bool  # stream_format "sse": server-sent events (always streamed)
    stock_voice: bool  # `voice` is one of OpenAI's names: "default" speaks when no voice has that name
    ssml_voices: frozenset[str] = frozenset()  # the voices its SSML names (synthesis.ssml_voice_ids)
    model: str = ""  # as given: a family's name, or any other (OpenAI's tts-1: the default family)


@dataclass(frozen=True)
class StartMessage:
    inputs: SynthesisInputs  # the session's settings, checked without a text (each segment brings its own)
    format: AudioFormat
    text: object  # text to begin with, taken as a text message is (None: none)
    model: str | None = None  # the model family of every segment; None: the default


@dataclass(frozen=True)
class VcRequest:
    inputs: ConversionInputs  # checked; the recordings still files, the voice not yet resolved
    format: AudioFormat
    stream: bool
    fields: Fields = TTS_FIELDS  # the names its errors use (source_audio, or `audio` when sent so)
    model: str | None = None  # the model family it names; None: the default


@dataclass(frozen=True)
class VoiceRegistration:
    audio: bytes  # the prompt recording's file
    text: str  # its transcript ("" when not given)
    text_field: str  # "text" or "prompt_text": the name the request used, which its errors name
    voice_id: str | None  # the id asked for
    name: str | None
    shared: bool  # asked to be a shared voice (admin keys only: the route checks the key)


# ---- the routes' bodies -----------------------------------------------------------------------------------

def parse_tts(body: dict, limits: Limits) -> TtsRequest:
    check_known(body, TTS_KEYS, "/v1/tts")
    fmt = check_format(body.get("format", "wav"), "format")
    stream = check_bool(body.get("stream", False), "stream")
    body = resolve_aliases(body)
    inputs = synthesis_fields(body, body.get("text"), limits)
    with TTS_FIELDS.named():
        inputs.check(limits.max_text_chars)
    return TtsRequest(inputs, fmt, stream, ssml_voice_ids(inputs, TTS_FIELDS), model_name(body.get("model")))


def parse_start(message: dict, limits: Limits) -> StartMessage:
    """The WebSocket's start message (its `type` already read)."""
    check_known(message, START_KEYS, "the start message")
    fmt = check_format(message.get("format", "pcm_f32"), "format")
    message = resolve_aliases(message)
    inputs = synthesis_fields(message, "", limits)
    with TTS_FIELDS.named():
        inputs.check_settings()
    return StartMessage(inputs, fmt, message.get("text"), model_name(message.get("model")))


def parse_vc_message(message: dict, limits: Limits) -> tuple[PromptAudio, Fields]:
    """A WebSocket {"type": "vc", "source_audio": base64} message (`audio`: the same): the recording to speak again,
    as a file, and the names its errors use."""
    check_known(message, frozenset({"type", "source_audio", "audio"}), "the vc message")
    fields = TTS_FIELDS.sent(message)
    message = resolve_aliases(message, SOURCE_ALIASES)
    source = decode_base64(message.get("source_audio"), fields.source, limits.max_upload_bytes)
    return PromptAudio(file_bytes=source), fields


def parse_speech(body: dict, limits: Limits) -> SpeechRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InvalidInput("model", "is required (cosyvoice2 or cosyvoice3; any other name, e.g. tts-1, is the "
                                    "default model)")
    fmt = check_format(body.get("response_format", "mp3"), "response_format", OPENAI_FORMATS)
    stream = check_bool(body.get("stream", True), "stream")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise InvalidInput("stream_format", f"must be audio or sse, got {stream_format!r}")
    marks = given(body.get("marks"), False)
    if marks is not False and stream_format != "sse":
        raise InvalidInput("marks", "speech marks need stream_format sse (they come as events among the audio)")
    voice = openai_voice(body.get("voice"))
    instructions = body.get("instructions") or None
    inputs = SynthesisInputs(text=body.get("input"), mode="instruct2" if instructions else "zero_shot",
                             instruct_text=given(instructions, ""), voice_id=voice,
                             seed=seed_or_new(body.get("seed")), speed=given(body.get("speed"), 1.0), marks=marks)
    with OPENAI_FIELDS.named():
        inputs.check(limits.max_text_chars)
    return SpeechRequest(inputs, fmt, stream, stream_format == "sse", voice.lower() in OPENAI_VOICES,
                         ssml_voice_ids(inputs, OPENAI_FIELDS), model)


def parse_vc(form: dict, limits: Limits) -> VcRequest:
    """The multipart fields of /v1/vc: bytes for the two recordings, strings for the rest."""
    check_known(form, VC_KEYS, "/v1/vc")
    fields = TTS_FIELDS.sent(form)
    form = resolve_aliases(form, SOURCE_ALIASES)
    fmt = check_format(form.get("format", "wav"), "format")
    stream = form_bool(form.get("stream"), "stream")
    seed = form_number(form.get("seed"), int, "seed", "must be an integer")
    speed = form_number(form.get("speed"), float, "speed", f"must be a number from {MIN_SPEED} to {MAX_SPEED}")
    source, prompt_audio = form.get("source_audio"), form.get("prompt_audio")
    if not source:
        raise InvalidInput(fields.source, "is required: the recording to convert (a WAV, FLAC or OGG file)")
    for field, data in ((fields.source, source), ("prompt_audio", prompt_audio)):
        if data is not None and len(data) > limits.max_upload_bytes:
            raise too_large_upload(field, len(data), limits.max_upload_bytes, field)
    inputs = ConversionInputs(source=PromptAudio(file_bytes=source), voice_id=form.get("voice_id") or None,
                              audio=None if prompt_audio is None else PromptAudio(file_bytes=prompt_audio),
                              seed=seed_or_new(seed), speed=given(speed, 1.0))
    with fields.named():
        inputs.check()
    return VcRequest(inputs, fmt, stream, fields, model_name(form.get("model") or None))


def parse_registration(values: dict, limits: Limits) -> VoiceRegistration:
    """A JSON body (audio: base64) or the multipart fields (audio: the file's bytes) of POST /v1/voices."""
    audio = values.get("audio")
    if audio is not None and not isinstance(audio, bytes):
        audio = decode_base64(audio, "audio", limits.max_upload_bytes)
    shared = form_bool(values.get("shared"), "shared")
    if not audio:
        raise InvalidInput("audio", "is required: the prompt recording (WAV, FLAC or OGG)")
    if len(audio) > limits.max_upload_bytes:
        raise too_large_upload("audio", len(audio), limits.max_upload_bytes, "audio")
    text_field = "text" if "text" in values else "prompt_text"  # either name; errors use the one sent
    text = optional_text(values.get(text_field), text_field) or ""
    voice_id = optional_text(values.get("id"), "id") or None
    name = optional_text(values.get("name"), "name") or None
    return VoiceRegistration(audio, text, text_field, voice_id, name, shared)


# ---- pieces -------------------------------------------------------------------------------------------------

async def json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise InvalidInput("body", "is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidInput("body", "must be a JSON object")
    return body


def synthesis_fields(body: Mapping, text: object, limits: Limits) -> SynthesisInputs:
    """The synthesis fields of /v1/tts and the WebSocket start message (aliases resolved) as the wire request,
    not yet checked; a prompt recording as the file it came as."""
    prompt_audio = body.get("prompt_audio")
    if prompt_audio is not None:
        prompt_audio = PromptAudio(file_bytes=decode_base64(prompt_audio, "prompt_audio", limits.max_upload_bytes))
    return SynthesisInputs(text=text, mode=given(body.get("mode"), "zero_shot"),
                           instruct_text=given(body.get("instruct"), ""), voice_id=body.get("voice_id"),
                           audio=prompt_audio, prompt_text=body.get("prompt_text"), seed=seed_or_new(body.get("seed")),
                           chunk_overrides=chunk_overrides(body), text_frontend=given(body.get("text_frontend"), True),
                           speed=given(body.get("speed"), 1.0), text_mode=body.get("text_mode", "sentences"),
                           text_type=body.get("text_type"), marks=given(body.get("marks"), False))


def model_name(value: object) -> str | None:
    """A request's `model`: a model name (a family's, e.g. cosyvoice3, or one of its Triton models), or None."""
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise InvalidInput("model", f"must be a model name such as cosyvoice2 or cosyvoice3, got {short_repr(value)}")
    return value


def given(value: object, default: object) -> object:
    """`value`, or `default` when it is None (JSON null: not given)."""
    return default if value is None else value


def seed_or_new(seed: object) -> object:
    """The request's seed, or a random one when it has none (checked with the rest)."""
    return secrets.randbelow(SEED_LIMIT) if seed is None else seed


def check_known(body: Mapping, known: frozenset[str], where: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidInput(unknown[0], f"is not a field of {where} (fields: {', '.join(sorted(known))})")


def check_format(value: object, field: str, names: tuple[str, ...] = TTS_FORMATS) -> AudioFormat:
    """The audio format a request names in `field`, one of `names`."""
    if not isinstance(value, str) or value not in names:
        raise InvalidInput(field, f"must be one of {', '.join(names)}, got {value!r}")
    return audio_format(value)


def check_bool(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(field, "must be true or false")
    return value


def form_bool(value: object, field: str) -> bool:
    """A JSON true/false, or a form's "true"/"1" and "false"/"0" ("" and absent: false)."""
    if value in (None, False, "", "false", "0"):
        return False
    if value in (True, "true", "1"):
        return True
    raise InvalidInput(field, f"must be true or false, got {value!r}")


def form_number(value: str | None, kind: type, field: str, problem: str) -> int | float | None:
    """A form's number as `kind` (absent or "": None); its range is checked with the rest of the request."""
    if value is None or value == "":
        return None
    try:
        return kind(value)
    except ValueError:
        raise InvalidInput(field, f"{problem}, got {value!r}") from None


def optional_text(value: object, field: str) -> str | None:
    """`value` if it is None or a string without control characters (errors name `field` as the request did)."""
    try:
        check_optional_text(value, field)
    except InvalidInput as exc:
        raise InvalidInput(field, exc.problem) from None
    return value


def decode_base64(value: object, field: str, max_bytes: int) -> bytes:
    if not isinstance(value, str):
        raise InvalidInput(field, "must be a base64 string of an audio file (WAV, FLAC or OGG)")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(field, "is not valid base64") from None
    if len(data) > max_bytes:
        raise too_large_upload(field, len(data), max_bytes, field)
    return data


def openai_voice(value: object) -> str:
    """OpenAI's `voice`: an id, or {"id": ...}."""
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise InvalidInput("voice", "is required: a registered voice id, or {\"id\": ...}")
    return value
