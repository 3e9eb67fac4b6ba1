"""Each gateway route's body -> its typed request (gateway/route_requests.py) -> the Triton inputs (wire/requests.py),
without a server: the fields each API names, the library's checks (the ones the model runs on its tensors)
with errors naming the API's field, a prompt recording decoded once and sent as samples, a voice read once."""
from __future__ import annotations

import asyncio
import base64
import io
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from aiohttp import web

from cosyvoice_triton.errors import InvalidInput, NotFound
from cosyvoice_triton.gateway import auth
from cosyvoice_triton.gateway.config import Limits
from cosyvoice_triton.gateway.default_voice import DefaultVoice
from cosyvoice_triton.errors import TooLarge
from cosyvoice_triton.gateway.errors import http_status
from cosyvoice_triton.gateway.fields import OPENAI_FIELDS, REGISTER_FIELDS, TTS_FIELDS
from cosyvoice_triton.gateway.route_requests import (START_KEYS, TTS_KEYS, VC_KEYS, parse_registration, parse_speech,
                                               parse_start, parse_tts, parse_vc, parse_vc_message)
from cosyvoice_triton.gateway.routing import CostModel
from cosyvoice_triton.gateway.state import COSTS, DEFAULT_VOICE, STORE
from cosyvoice_triton.gateway.synthesis import decode_recording, prepare, prepare_conversion, routing_cost
from cosyvoice_triton.messages import SEED_LIMIT
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.wire.names import INPUT_NAMES
from cosyvoice_triton.wire.requests import parse_synthesis_inputs
from cosyvoice_triton.wire.tensors import TensorReader
from cosyvoice_triton.voices.store import VoiceRecord

LIMITS = Limits(max_text_chars=50)
RATE = 16000
GATEWAY = Path(__file__).resolve().parents[1] / "gateway"


def wav(seconds: float = 2.0) -> bytes:
    out = io.BytesIO()
    sf.write(out, speech_like(seconds, RATE, seed=3), RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def field_of(error: pytest.ExceptionInfo) -> str:
    return error.value.field


# ---- /v1/tts ----------------------------------------------------------------------------------------------

def test_a_tts_body_becomes_the_cosyvoice2_request():
    request = parse_tts({"text": "Hi.", "voice": "me", "mode": "instruct2", "instruct": "Softly.", "seed": 5,
                         "speed": 1.5, "chunk_first_hop": 10, "chunk_policy": "adaptive", "text_frontend": False,
                         "format": "mp3", "stream": True}, LIMITS)
    assert (request.format.name, request.stream) == ("mp3", True)
    tensors = request.inputs.tensors()
    assert {name: tensors[name].tolist() for name in tensors} == {
        "target_text": [b"Hi."], "reference_audio_id": [b"me"], "mode": [b"instruct2"], "instruct_text": [b"Softly."],
        "seed": [5], "speed": [1.5], "chunk_first_hop": [10], "chunk_policy": [b"adaptive"], "text_frontend": [False]}
    assert tensors["seed"].dtype == np.uint64 and tensors["chunk_first_hop"].dtype == np.int32


def test_defaults_are_not_sent_and_a_request_without_a_seed_gets_one():
    tensors = parse_tts({"text": "Hi.", "speed": None, "mode": None}, LIMITS).inputs.tensors()
    assert sorted(tensors) == ["mode", "seed", "target_text"]  # no voice yet: prepare settles it
    assert tensors["mode"].tolist() == [b"zero_shot"] and 0 <= int(tensors["seed"][0]) < SEED_LIMIT


@pytest.mark.parametrize("body, field", [
    ({"text": ""}, "text"), ({"text": 5}, "text"), ({"text": "x" * 51}, "text"), ({"text": "a\x00b"}, "text"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": "1"}, "seed"), ({"seed": True}, "seed"),
    ({"mode": "sing"}, "mode"), ({"mode": "instruct2"}, "instruct"), ({"instruct": 5}, "instruct"),
    ({"prompt_text": "\x1b[0m"}, "prompt_text"), ({"speed": 9}, "speed"), ({"speed": "fast"}, "speed"),
    ({"text_frontend": "no"}, "text_frontend"), ({"chunk_first_hop": 2}, "chunk_first_hop"),
    ({"chunk_first_hop": "x"}, "chunk_first_hop"), ({"chunk_first_hop": 2**40}, "chunk_first_hop"),
    ({"chunk_hop_scale": float("nan")}, "chunk_hop_scale"), ({"chunk_max_hop": 5}, "chunk_max_hop"),
    ({"chunk_policy": 5}, "chunk_policy"), ({"format": "exe"}, "format"), ({"stream": "yes"}, "stream"),
    ({"prompt_audio": "not base64!!"}, "prompt_audio"), ({"voice": "a", "voice_id": "b"}, "voice"),
    ({"nope": 1}, "nope"),
])
def test_a_bad_tts_field_is_a_400_naming_it(body, field):
    with pytest.raises(InvalidInput) as error:
        parse_tts({"text": "Hi.", **body}, LIMITS)
    assert field_of(error) == field and http_status(error.value) == 400


def test_the_gateway_and_the_model_run_the_same_checks():
    """A direct gRPC caller meets the check the gateway ran, naming the input the gateway maps to its field."""
    for body, tensors in [({"speed": 9.5}, {"speed": np.array([9.5], np.float32)}),
                          ({"chunk_first_hop": 2}, {"chunk_first_hop": np.array([2], np.int32)}),
                          ({"mode": "instruct2"}, {"mode": np.array([b"instruct2"], object)}),
                          ({"text": " "}, {"target_text": np.array([b" "], object)})]:
        with pytest.raises(InvalidInput) as gateway:
            parse_tts({"text": "Hi.", **body}, LIMITS)
        good = parse_tts({"text": "Hi.", "voice_id": "v"}, LIMITS).inputs.tensors()
        with pytest.raises(InvalidInput) as model:
            parse_synthesis_inputs(TensorReader({**good, **tensors}), LIMITS.max_text_chars)
        assert (TTS_FIELDS.of_input(model.value.field), model.value.problem) == (gateway.value.field,
                                                                                gateway.value.message.split(": ", 1)[1])


def test_the_model_reads_back_what_the_gateway_sent():
    inputs = parse_tts({"text": "Hi.", "voice_id": "v", "seed": 3, "speed": 0.5, "chunk_max_hop": 60,
                        "instruct": "x", "mode": "instruct2"}, LIMITS).inputs
    parsed = parse_synthesis_inputs(TensorReader({**inputs.tensors(), "top_k": np.array([7], np.int32)}),
                                    LIMITS.max_text_chars)
    assert parsed == replace(inputs, sampling={"top_k": 7})  # the server's sampling fills the rest


# ---- /v1/audio/speech ---------------------------------------------------------------------------------------

def test_an_openai_body_becomes_the_same_request():
    speech = parse_speech({"model": "tts-1", "input": "Hi.", "voice": {"id": "alloy"}, "instructions": "Slowly.",
                           "response_format": "pcm", "stream_format": "sse", "speed": None, "seed": 1}, LIMITS)
    assert (speech.format.name, speech.events, speech.stock_voice) == ("pcm", True, True)
    tensors = speech.inputs.tensors()
    assert (tensors["mode"].tolist(), tensors["instruct_text"].tolist()) == ([b"instruct2"], [b"Slowly."])
    assert tensors["reference_audio_id"].tolist() == [b"alloy"] and "speed" not in tensors
    assert not parse_speech({"model": "m", "input": "Hi.", "voice": "me"}, LIMITS).stock_voice


@pytest.mark.parametrize("body, field", [
    ({"model": ""}, "model"), ({"input": ""}, "input"), ({"input": "x" * 51}, "input"), ({"voice": None}, "voice"),
    ({"voice": {"id": 5}}, "voice"), ({"instructions": 5}, "instructions"), ({"instructions": "\x1b"}, "instructions"),
    ({"speed": 0}, "speed"), ({"seed": -1}, "seed"), ({"response_format": "pcm_f32"}, "response_format"),
    ({"stream_format": "x"}, "stream_format"), ({"stream": 1}, "stream"),
])
def test_a_bad_openai_field_is_a_400_naming_it(body, field):
    with pytest.raises(InvalidInput) as error:
        parse_speech({"model": "tts-1", "input": "Hi.", "voice": "default", **body}, LIMITS)
    assert field_of(error) == field


# ---- the WebSocket ------------------------------------------------------------------------------------------

def test_a_start_message_is_the_session_settings_checked_without_a_text():
    start = parse_start({"type": "start", "voice": "me", "text_mode": "bistream", "seed": 4, "chunk_hop_scale": 1.5,
                         "text": "Hello"}, LIMITS)
    assert (start.format.name, start.text, start.inputs.text, start.inputs.voice_id) == ("pcm_f32", "Hello", "", "me")
    segment = replace(start.inputs, text="Hello there.", text_stream_id="s1").tensors()
    assert segment["text_mode"].tolist() == [b"bistream"] and segment["text_stream_id"].tolist() == [b"s1"]
    assert segment["chunk_hop_scale"].tolist() == [1.5]
    for message, field in [({"text_mode": "x"}, "text_mode"), ({"seed": -1}, "seed"), ({"nope": 1}, "nope"),
                           ({"chunk_hop_scale": "x"}, "chunk_hop_scale"), ({"format": "exe"}, "format")]:
        with pytest.raises(InvalidInput) as error:
            parse_start({"type": "start", **message}, LIMITS)
        assert field_of(error) == field
    for name in ("source_audio", "audio"):  # audio: the name it had before, still taken
        source, fields = parse_vc_message({"type": "vc", name: b64(b"RIFF")}, LIMITS)
        assert (source.file_bytes, fields.source) == (b"RIFF", name)
        with pytest.raises(InvalidInput) as error:
            parse_vc_message({"type": "vc", name: 5}, LIMITS)
        assert field_of(error) == name  # errors name the field as it was sent


# ---- /v1/vc and /v1/voices ------------------------------------------------------------------------------------

def test_a_vc_form_becomes_a_conversion():
    vc = parse_vc({"source_audio": b"src", "voice_id": "me", "seed": "12", "speed": "1.5", "stream": "true"}, LIMITS)
    assert (vc.inputs.source.file_bytes, vc.inputs.voice_id, vc.inputs.seed, vc.inputs.speed, vc.stream) == (
        b"src", "me", 12, 1.5, True)
    assert parse_vc({"audio": b"src"}, LIMITS).inputs.source.file_bytes == b"src"  # the name it had before
    for form, field in [({}, "source_audio"), ({"source_audio": b"", "audio": b"src"}, "audio"),
                        ({"source_audio": b""}, "source_audio")]:
        with pytest.raises(InvalidInput) as error:
            parse_vc(form, LIMITS)
        assert field_of(error) == field
    for form, field in [({"seed": "x"}, "seed"), ({"seed": "-1"}, "seed"), ({"speed": "9"}, "speed"),
                        ({"speed": "fast"}, "speed"), ({"stream": "yes"}, "stream"), ({"audio": b""}, "audio"),
                        ({"format": "exe"}, "format"), ({"text": "x"}, "text")]:
        with pytest.raises(InvalidInput) as error:
            parse_vc({"audio": b"src", **form}, LIMITS)
        assert field_of(error) == field
    with pytest.raises(TooLarge):
        parse_vc({"audio": b"x" * 11}, Limits(max_upload_bytes=10))


def test_a_registration_from_json_or_a_form():
    by_json = parse_registration({"audio": b64(b"RIFF"), "prompt_text": "hi", "id": "me", "shared": True}, LIMITS)
    by_form = parse_registration({"audio": b"RIFF", "prompt_text": "hi", "id": "me", "shared": "true"}, LIMITS)
    assert by_json == by_form and (by_json.text_field, by_json.text, by_json.shared) == ("prompt_text", "hi", True)
    for values, field in [({"audio": 5}, "audio"), ({"audio": None}, "audio"), ({"text": "\x1b[31m"}, "text"),
                          ({"prompt_text": 5}, "prompt_text"), ({"id": 5}, "id"), ({"name": "a\x00"}, "name"),
                          ({"shared": "maybe"}, "shared")]:
        with pytest.raises(InvalidInput) as error:
            parse_registration({"audio": b"RIFF", **values}, LIMITS)
        assert field_of(error) == field


def test_each_api_names_the_inputs_its_own_way():
    assert [TTS_FIELDS.of_input(n) for n in ("target_text", "reference_wav", "reference_audio_id", "source_audio")] == [
        "text", "prompt_audio", "voice_id", "source_audio"]
    assert [OPENAI_FIELDS.of_input(n) for n in ("target_text", "reference_audio_id", "instruct_text")] == [
        "input", "voice", "instructions"]
    assert [REGISTER_FIELDS.of_input(n) for n in ("reference_sample_rate", "voice_id", "reference_text")] == [
        "audio", "id", "text"]
    assert TTS_FIELDS.of_input("chunk_max_hop") == "chunk_max_hop" and TTS_FIELDS.of_input(None) is None


# ---- once per request: the recording decoded, the voice read ----------------------------------------------------

class CountingStore:
    def __init__(self, *records: VoiceRecord):
        self.records = {record.voice_id: record for record in records}
        self.reads: list[str] = []

    def info(self, voice_id: str, owner: str | None = None) -> VoiceRecord:
        self.reads.append(voice_id)
        if voice_id not in self.records:
            raise NotFound("reference_audio_id", f"no voice {voice_id!r}")
        return self.records[voice_id]


def voice(voice_id: str, text: str = "a transcript") -> VoiceRecord:
    return VoiceRecord(voice_id, text, "sha", 50, 0.0, None)


def run(app: web.Application, coroutine_of):
    async def main():
        auth._CURRENT.set(auth.KEYLESS_TENANT)
        return await coroutine_of(app)
    return asyncio.run(main())


def app_with(store: CountingStore) -> web.Application:
    app = web.Application()
    app[STORE], app[COSTS], app[DEFAULT_VOICE] = store, CostModel(), DefaultVoice(enabled=False)
    return app


def test_a_prompt_recording_is_decoded_once_and_sent_as_samples():
    request = parse_tts({"text": "Hi.", "prompt_audio": b64(wav()), "prompt_text": "a prompt"}, LIMITS)
    store = CountingStore()
    inputs, prompt_tokens = run(app_with(store), lambda app: prepare(app, request.inputs, TTS_FIELDS))
    tensors = inputs.tensors()
    assert "reference_audio" not in tensors and tensors["reference_sample_rate"].tolist() == [RATE]
    assert tensors["reference_wav"].shape == (2 * RATE,) and prompt_tokens == 50 and store.reads == []
    assert run(app_with(store), lambda app: decode_recording(inputs.audio, "prompt_audio")) is inputs.audio
    with pytest.raises(InvalidInput) as error:
        run(app_with(store), lambda app: prepare(app, replace(request.inputs, prompt_text=None), TTS_FIELDS))
    assert field_of(error) == "prompt_text"
    noise = parse_tts({"text": "Hi.", "prompt_audio": b64(b"RIFF" + bytes(100)), "prompt_text": "x"}, LIMITS)
    with pytest.raises(InvalidInput) as error:
        run(app_with(store), lambda app: prepare(app, noise.inputs, TTS_FIELDS))
    assert field_of(error) == "prompt_audio"


def test_a_voice_is_read_once_and_an_unregistered_openai_name_speaks_as_default():
    store = CountingStore(voice("default"), voice("me", text=""))
    speech = parse_speech({"model": "m", "input": "Hi.", "voice": "alloy"}, LIMITS)
    inputs, _ = run(app_with(store), lambda app: prepare(app, speech.inputs, OPENAI_FIELDS, speech.stock_voice))
    assert inputs.voice_id == "default" and store.reads == ["alloy", "default"]
    store.reads.clear()
    tts = parse_tts({"text": "Hi.", "voice_id": "me", "mode": "cross_lingual"}, LIMITS)
    inputs, tokens = run(app_with(store), lambda app: prepare(app, tts.inputs, TTS_FIELDS))
    assert (inputs.voice_id, tokens, store.reads) == ("me", 50, ["me"])
    with pytest.raises(InvalidInput) as error:  # zero_shot with a voice registered without a transcript
        run(app_with(store), lambda app: prepare(app, replace(tts.inputs, mode="zero_shot"), TTS_FIELDS))
    assert field_of(error) == "prompt_text"


def test_a_conversion_sends_both_recordings_as_samples_and_costs_its_source():
    store = CountingStore(voice("default"))
    vc = parse_vc({"audio": wav(3.0), "prompt_audio": wav(2.0)}, LIMITS)
    app = app_with(store)
    inputs, prompt_tokens = run(app, lambda app: prepare_conversion(app, vc.inputs, TTS_FIELDS))
    tensors = inputs.tensors()
    assert tensors["mode"].tolist() == [b"vc"] and tensors["source_wav"].shape == (3 * RATE,)
    assert "source_audio" not in tensors and "reference_audio" not in tensors and store.reads == []
    assert routing_cost(app, inputs, prompt_tokens) == app[COSTS].estimate("", 50 + 75, True)
    with pytest.raises(InvalidInput) as error:
        run(app, lambda app: prepare_conversion(app, replace(vc.inputs, voice_id="me"), TTS_FIELDS))
    assert field_of(error) == "voice_id"  # an id and a recording: not both


# ---- where names live ---------------------------------------------------------------------------------------

# the official CosyVoice servers' form and proto fields (gateway/official_api.py): API fields too, though
# two of them are spelled like cosyvoice2 inputs
OFFICIAL_FIELDS = {"tts_text", "spk_id", "prompt_wav", "prompt_audio", "prompt_text", "instruct_text"}
API_FIELDS = (START_KEYS | TTS_KEYS | VC_KEYS | OFFICIAL_FIELDS
              | {"input", "voice", "instructions", "id", "name", "audio", "text"})
WIRE_ONLY = sorted(INPUT_NAMES - API_FIELDS)  # the Triton inputs no API field is named like


def test_tensor_names_appear_in_the_wire_package_alone():
    """The gateway names API fields; what the Triton inputs are called is the wire package's business."""
    assert {"target_text", "reference_audio_id", "reference_wav", "source_wav", "text_stream_id"} <= set(WIRE_ONLY)
    quoted = re.compile("|".join(rf"[\"']{re.escape(name)}[\"']" for name in WIRE_ONLY))
    offenders = [f"{path.name}: {match.group()}" for path in GATEWAY.glob("*.py")
                 for match in quoted.finditer(path.read_text())]
    assert offenders == []


def test_routes_import_shared_modules_not_each_other():
    imports = re.compile(r"^from \.(routes_\w+) import|^from \. import .*routes_", re.MULTILINE)
    offenders = [path.name for path in GATEWAY.glob("routes_*.py") if imports.search(path.read_text())]
    assert offenders == []
