"""The official CosyVoice server APIs (FastAPI and gRPC) mapped onto ours: one mapping (`KINDS`), shared by the HTTP
routes (routes_official.py) and the gRPC service (official_grpc.py); a prompt recording takes the gateway's one
decode-and-check path (`synthesis.decode_recording`), the gRPC one's raw PCM wrapped by `pcm16_wav`. What each
request becomes and why: docs/api/official.md#why-sft-and-instruct-answer-as-they-do.
"""
from __future__ import annotations

import io
import wave
from collections.abc import Mapping
from dataclasses import dataclass, replace

from aiohttp import web

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.audio_out import audio_format
from cosyvoice_triton.wire.requests import PromptAudio, SynthesisInputs

from .config import Limits
from .errors import too_large_upload
from .fields import Fields
from .route_requests import check_known, form_number, seed_or_new
from .synthesis import prepare, settle_voice, ssml_voice_ids

PCM = audio_format("pcm")  # the answer of every official request
PROMPT_PCM_RATE = 16000  # gRPC prompt_audio: raw 16-bit PCM at this rate
# What each API calls the wire request's fields (fields.py `Fields`); only the prompt recording differs.
HTTP_FIELDS = Fields(text="tts_text", voice_id="spk_id", audio="prompt_wav", prompt_text="prompt_text",
                     instruct_text="instruct_text")
GRPC_FIELDS = replace(HTTP_FIELDS, audio="prompt_audio")


@dataclass(frozen=True)
class Kind:
    """One official request kind: the fields it requires (wire request names, `Fields` renames them) and
    the mode it becomes (None: the voice decides, see the module docstring)."""

    name: str
    required: tuple[str, ...]
    mode: str | None


KINDS = {kind.name: kind for kind in (
    Kind("sft", ("text", "voice_id"), None),
    Kind("zero_shot", ("text", "prompt_text", "audio"), "zero_shot"),
    Kind("cross_lingual", ("text", "audio"), "cross_lingual"),
    Kind("instruct", ("text", "voice_id", "instruct_text"), "instruct2"),
    Kind("instruct2", ("text", "instruct_text", "audio"), "instruct2"),
)}


@dataclass(frozen=True)
class OfficialRequest:
    kind: Kind
    inputs: SynthesisInputs  # checked; the voice not yet resolved (sft: nor its mode)
    ssml_voices: frozenset[str] = frozenset()  # the voices its SSML names (synthesis.ssml_voice_ids)


def official_request(kind: Kind, values: Mapping[str, object], fields: Fields, limits: Limits) -> OfficialRequest:
    """An official request from its fields by the API's names (`fields`; the recording as a file's bytes;
    the extension `seed` as a string); a missing or unknown field is a 400 naming it."""
    names = {name: fields.name(name) for name in kind.required}
    check_known(values, frozenset({*names.values(), "seed"}), f"inference_{kind.name}")
    for name, field in names.items():
        if not values.get(field):
            raise InvalidInput(field, f"is required by inference_{kind.name}")
    given = {name: values[field] for name, field in names.items()}
    audio = given.get("audio")
    if audio is not None:
        if not isinstance(audio, bytes):
            raise InvalidInput(fields.audio, "must be an audio file (a file part of a multipart/form-data body)")
        if len(audio) > limits.max_upload_bytes:
            raise too_large_upload(fields.audio, len(audio), limits.max_upload_bytes, fields.audio)
        audio = PromptAudio(file_bytes=audio)
    inputs = SynthesisInputs(text=given["text"], mode=kind.mode or "zero_shot",
                             instruct_text=given.get("instruct_text", ""), voice_id=given.get("voice_id"),
                             audio=audio, prompt_text=given.get("prompt_text"),
                             seed=seed_or_new(form_number(values.get("seed"), int, "seed", "must be an integer")))
    with fields.named():
        inputs.check(limits.max_text_chars)
    return OfficialRequest(kind, inputs, ssml_voice_ids(inputs, fields))


async def prepare_official(app: web.Application, official: OfficialRequest,
                           fields: Fields) -> tuple[SynthesisInputs, int]:
    """The synthesis with its voice settled (`synthesis.prepare`), and the voice's prompt speech tokens. sft
    speaks zero_shot with the voice's stored transcript, or cross_lingual when it was registered without one."""
    if official.kind.mode is not None:
        return await prepare(app, official.inputs, fields, ssml_voices=official.ssml_voices)
    inputs, prompt_tokens, transcript = await settle_voice(app, official.inputs, fields)
    return replace(inputs, mode="zero_shot" if (transcript or "").strip() else "cross_lingual"), prompt_tokens


def pcm16_wav(pcm: bytes, field: str, rate: int = PROMPT_PCM_RATE) -> bytes:
    """Raw 16-bit little-endian mono PCM at `rate` as the bytes of a WAV file (empty stays empty)."""
    if not pcm:
        return b""
    if len(pcm) % 2:
        raise InvalidInput(field, f"must be 16-bit PCM (an even number of bytes), got {len(pcm)} bytes")
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm)
    return out.getvalue()
