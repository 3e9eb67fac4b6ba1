"""The official runtime's Triton clients against our server: cosyvoice2_official and cosyvoice2_official_offline
(CosyVoice3's cosyvoice3_official and cosyvoice3_official_offline on a real server: tests/test_cv3_served.py).

The official clients (runtime/triton_trtllm of FunAudioLLM/CosyVoice: client_grpc.py, streaming and offline, and
client_http.py) send every tensor with a leading batch dimension (their config has max_batch_size > 0):
reference_wav FP32 [1, N] at 16 kHz, zero-padded past reference_wav_len INT32 [1, 1], reference_text and
target_text BYTES [1, 1]; the "spk2info cache" request sends target_text alone. The requests here are built
from those facts (names, shapes, dtypes, padding), plus our `seed` [1, 1] for deterministic audio, and their
audio is compared with our native models' for the same voice, text and seed.

One tritonserver for the module, started like `cosyvoice-triton serve` with the official models on, on a tiny
random folder. The conversion itself (`from_official_form`) is tested first, without Triton.
"""
from __future__ import annotations

import json
import urllib.error
from dataclasses import replace
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.errors import InvalidInput, from_wire
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.client.triton_client import synthesis_request
from cosyvoice_triton.wire.names import (COSYVOICE2_OFFICIAL, COSYVOICE2_OFFICIAL_OFFLINE, COSYVOICE3_OFFICIAL,
                                         COSYVOICE3_OFFICIAL_OFFLINE, DEFAULT_VOICE_ID, OFFICIAL_MODELS,
                                         REFERENCE_WAV_LEN)
from cosyvoice_triton.wire.official import from_official_form
from cosyvoice_triton.wire.requests import (PromptAudio, RegisterInputs, SynthesisInputs, TextAppend,
                                            parse_cosyvoice2_request)
from cosyvoice_triton.wire.tensors import TensorReader
from triton_harness import GrpcStream, grpc_inputs, tritonserver_or_skip

RATE = 16000  # the official server's only prompt rate
PROMPT_TEXT = "a short voice prompt"
TEXT = "The official client asks for this sentence."
SEED = 7
RATIO = 3.0  # as test_triton_serving: the random LLM stops sooner
ATOL = 2e-4  # as test_triton_serving: equal up to float rounding of batched flow and vocoder calls
STREAMING, OFFLINE = COSYVOICE2_OFFICIAL, COSYVOICE2_OFFICIAL_OFFLINE


def prompt_wav() -> np.ndarray:
    return speech_like(2.0, RATE, seed=3, pitch_hz=110.0)


def official_inputs(text: str, wav: np.ndarray | None = None, prompt_text: str | None = None,
                    padded_to: int | None = None, seed: int | None = SEED) -> dict[str, np.ndarray]:
    """A request as the official clients build it (`prepare_request_input_output`, `prepare_request`): the voice
    tensors with `wav` (zeros up to `padded_to` samples), or target_text alone (their spk2info-cache form)."""
    values = {}
    if wav is not None:
        samples = np.zeros((1, padded_to or wav.size), np.float32)
        samples[0, :wav.size] = wav
        values = {"reference_wav": samples, "reference_wav_len": np.array([[wav.size]], np.int32),
                  "reference_text": np.array([prompt_text], dtype=object).reshape(1, 1)}
    values["target_text"] = np.array([text], dtype=object).reshape(1, 1)
    if seed is not None:
        values["seed"] = np.array([[seed]], np.uint64)
    return values


def converted(values: dict[str, np.ndarray], has_voice=lambda voice_id: True):
    return parse_cosyvoice2_request(TensorReader(from_official_form(values, has_voice)), 2000)


# ---- the conversion, without Triton -------------------------------------------------------------------

def test_official_arrays_become_the_native_request():
    wav = prompt_wav()
    inputs = converted(official_inputs(TEXT, wav, PROMPT_TEXT, padded_to=3 * wav.size))
    assert isinstance(inputs, SynthesisInputs)
    assert (inputs.text, inputs.prompt_text, inputs.seed, inputs.voice_id) == (TEXT, PROMPT_TEXT, SEED, None)
    assert inputs.audio.sample_rate == RATE  # not sent: the official server's rate
    np.testing.assert_array_equal(inputs.audio.samples, wav)  # the padding past reference_wav_len is gone
    native = parse_cosyvoice2_request(TensorReader(synthesis_request(TEXT, prompt_audio=wav, prompt_sample_rate=RATE,
                                                                    prompt_text=PROMPT_TEXT, seed=SEED).tensors()), 2000)
    assert native.text == inputs.text and native.audio.sample_rate == inputs.audio.sample_rate


def test_our_inputs_work_in_the_official_form_and_a_given_rate_wins():
    values = official_inputs(TEXT, prompt_wav(), PROMPT_TEXT)
    values.update(speed=np.array([[1.5]], np.float32), reference_sample_rate=np.array([[24000]], np.int32),
                  chunk_first_hop=np.array([[30]], np.int32))
    inputs = converted(values)
    assert (inputs.speed, inputs.audio.sample_rate, inputs.chunk_overrides) == (1.5, 24000, {"first_hop": 30})


def test_the_spk2info_form_speaks_in_the_default_voice_or_names_reference_wav():
    asked = []
    inputs = converted(official_inputs(TEXT), lambda voice_id: asked.append(voice_id) or True)
    assert (inputs.voice_id, inputs.audio, asked) == (DEFAULT_VOICE_ID, None, [DEFAULT_VOICE_ID])
    with pytest.raises(InvalidInput) as error:
        converted(official_inputs(TEXT), lambda voice_id: False)
    assert error.value.field == "reference_wav" and "'default'" in str(error.value)
    # A voice id the request names is its own (a missing one is NOT_FOUND, as in the native form).
    named = official_inputs(TEXT)
    named["reference_audio_id"] = np.array([[b"alice"]], dtype=object)
    assert converted(named, lambda voice_id: False).voice_id == "alice"


def test_a_text_piece_needs_no_voice():
    piece = {"target_text": np.array([[b" more"]], dtype=object), "text_stream_id": np.array([[b"s1"]], dtype=object),
             "text_append": np.array([[True]])}
    assert converted(piece, lambda voice_id: False) == TextAppend("s1", " more", False)


@pytest.mark.parametrize("name", ["reference_wav", "reference_wav_len", "target_text", "seed"])
def test_a_batch_other_than_one_is_refused_naming_the_input(name):
    values = official_inputs(TEXT, prompt_wav(), PROMPT_TEXT)
    values[name] = np.concatenate([values[name], values[name]])
    with pytest.raises(InvalidInput) as error:
        converted(values)
    assert error.value.field == name and "[2, " in str(error.value)


def test_the_native_form_honours_reference_wav_len_too():
    wav = prompt_wav()
    padded = np.concatenate([wav, np.zeros(RATE, np.float32)])
    values = {**synthesis_request(TEXT, prompt_audio=padded, prompt_sample_rate=RATE, prompt_text=PROMPT_TEXT).tensors(),
              REFERENCE_WAV_LEN: np.array([wav.size], np.int32)}
    inputs = parse_cosyvoice2_request(TensorReader(values), 2000)
    np.testing.assert_array_equal(inputs.audio.samples, wav)
    for bad in (padded.size + 1, -1):  # past the samples sent, or negative
        with pytest.raises(InvalidInput) as error:
            parse_cosyvoice2_request(TensorReader({**values, "reference_wav_len": np.array([bad], np.int32)}), 2000)
        assert error.value.field == "reference_wav_len"
    alone = {**synthesis_request(TEXT, voice_id="v").tensors(), REFERENCE_WAV_LEN: np.array([5], np.int32)}
    with pytest.raises(InvalidInput) as error:
        parse_cosyvoice2_request(TensorReader(alone), 2000)
    assert error.value.field == "reference_wav_len"


# ---- rendering and switches ---------------------------------------------------------------------------

def test_serve_renders_the_official_models_on_request_and_frontends_only(tmp_path):
    import pb_fake
    from cosyvoice_triton.server.launcher import ServeOptions, render_run_repository
    from cosyvoice_triton.server.templates import model_names

    lean = render_run_repository(ServeOptions(), tmp_path / "m", "v.sqlite", tmp_path / "lean")
    assert not set(OFFICIAL_MODELS) & set(model_names(lean))  # the library's default: off
    repo = render_run_repository(ServeOptions(official_models=True), tmp_path / "m", "v.sqlite", tmp_path / "all")
    for name, decoupled in ((STREAMING, True), (OFFLINE, False)):
        config = pb_fake.pbtxt_to_dict((repo / name / "config.pbtxt").read_text())
        assert config["max_batch_size"] == 1 and "dynamic_batching" not in config
        assert bool(config["model_transaction_policy"].get("decoupled", False)) is decoupled
        assert config["parameters"]["tensor_form"] == {"string_value": "official"}
    native = pb_fake.pbtxt_to_dict((repo / "cosyvoice2" / "config.pbtxt").read_text())
    assert native["max_batch_size"] == 0 and native["parameters"]["tensor_form"] == {"string_value": "native"}
    assert native["parameters"]["family"] == config["parameters"]["family"] == {"string_value": "cosyvoice2"}
    frontend = ServeOptions(official_models=True, role="frontend", backends=("grpc://b:8001",))
    assert {STREAMING, OFFLINE} <= set(model_names(render_run_repository(frontend, tmp_path / "m", "v", tmp_path / "f")))
    backend = ServeOptions(official_models=True, role="backend")
    assert model_names(render_run_repository(backend, tmp_path / "m", "v", tmp_path / "b")) == ["token2wav"]


def test_a_cosyvoice3_folder_gets_the_official_models_named_for_its_family(tmp_path):
    import pb_fake
    from cosyvoice_triton.server.launcher import ServeOptions, render_run_repository
    from cosyvoice_triton.server.templates import model_names

    folder = tmp_path / "cv3"
    folder.mkdir()
    (folder / "cosyvoice3.yaml").touch()  # the yaml decides the family (family.family_of)
    names = set(model_names(render_run_repository(ServeOptions(official_models=True), folder, "v", tmp_path / "r")))
    assert {COSYVOICE3_OFFICIAL, COSYVOICE3_OFFICIAL_OFFLINE} <= names and not {STREAMING, OFFLINE} & names
    for name, decoupled in ((COSYVOICE3_OFFICIAL, True), (COSYVOICE3_OFFICIAL_OFFLINE, False)):
        config = pb_fake.pbtxt_to_dict((tmp_path / "r" / name / "config.pbtxt").read_text())
        assert config["name"] == name and config["max_batch_size"] == 1
        assert bool(config["model_transaction_policy"].get("decoupled", False)) is decoupled
        assert config["parameters"]["tensor_form"] == {"string_value": "official"}
        assert config["parameters"]["family"] == {"string_value": "cosyvoice3"}
    lean = set(model_names(render_run_repository(ServeOptions(), folder, "v", tmp_path / "lean")))
    assert not set(OFFICIAL_MODELS) & lean


def test_a_model_named_for_one_family_refuses_a_folder_of_the_other(tmp_path):
    from cosyvoice_triton.errors import ParameterError
    from cosyvoice_triton.triton.params import CosyVoice2Params, check_family

    (tmp_path / "cosyvoice2.yaml").touch()
    params = CosyVoice2Params(model_dir=str(tmp_path), voice_store=None, max_workers=1, max_pending=1,
                              max_text_chars=10, llm_model="llm", token2wav_model="token2wav",
                              prompt_encoder_model="prompt_encoder", family="cosyvoice3")
    with pytest.raises(ParameterError) as error:
        check_family(params, COSYVOICE3_OFFICIAL)
    assert "cosyvoice3_official" in str(error.value) and "cosyvoice2.yaml" in str(error.value)
    check_family(replace(params, family="cosyvoice2"), "cosyvoice2")


def test_serve_and_up_turn_them_on_by_default():
    from cosyvoice_triton.cli import build_parser, serve_options_from_args
    from cosyvoice_triton.gateway.up import serve_options

    parser = build_parser()
    assert serve_options_from_args(parser.parse_args(["serve"])).official_models is True
    assert serve_options_from_args(parser.parse_args(["serve", "--no-official-models"])).official_models is False
    assert serve_options(parser.parse_args(["up"]), Path("m"), None).official_models is True
    assert serve_options(parser.parse_args(["up", "--no-official-models"]), Path("m"), None).official_models is False


def test_the_parameter_types_agree():
    import typing

    from cosyvoice_triton.family import FAMILIES
    from cosyvoice_triton.wire.names import FAMILY_MODELS
    from cosyvoice_triton.wire.official import TENSOR_FORMS
    from cosyvoice_triton.triton.params import FamilyName, TensorForm

    assert typing.get_args(TensorForm) == TENSOR_FORMS
    assert typing.get_args(FamilyName) == tuple(family.name for family in FAMILIES) == tuple(FAMILY_MODELS)


# ---- against a real tritonserver ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from cosyvoice_triton.random_folder.write import write_random_model
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    binary = tritonserver_or_skip()
    model_dir = write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", seed=0)
    run_dir = tmp_path_factory.mktemp("serve")
    options = ServeOptions(model_dir=model_dir, run_dir=run_dir, http_port=None, grpc_port=None, metrics_port=None,
                           voice_store=str(run_dir / "voices.sqlite"), max_token_text_ratio=RATIO, torch_threads=1,
                           workers=2, official_models=True)
    process = prepare(options, binary=binary, die_with_parent=True)
    process.start()
    yield process
    process.stop()


def stream(server, model: str, values: dict) -> list[np.ndarray]:
    """The audio chunks of one decoupled request, read as client_grpc.py's streaming mode reads them."""
    with GrpcStream(server.grpc_url, timeout_s=180) as connection:
        responses = connection.infer(model, values)
    errors = [r.error for r in responses if r.error]
    assert not errors, errors
    assert responses[-1].final and "waveform" not in responses[-1].outputs  # the empty final response
    return [r.outputs["waveform"] for r in responses if "waveform" in r.outputs]


def infer(server, model: str, values: dict) -> np.ndarray:
    """One plain ModelInfer, as client_grpc.py's offline mode sends it."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer(model, grpc_inputs(values), request_id="0",
                              outputs=[grpcclient.InferRequestedOutput("waveform")], client_timeout=180)
    return result.as_numpy("waveform")


def http_post(server, model: str, body: dict) -> dict:
    """client_http.py's request: KServe v2 JSON to /v2/models/<model>/infer?request_id=0."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/infer?request_id=0",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as response:
        return json.loads(response.read())


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert [c.size for c in got] == [c.size for c in want]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def native_stream(server) -> list[np.ndarray]:
    return stream(server, "cosyvoice2", synthesis_request(TEXT, prompt_audio=prompt_wav(), prompt_sample_rate=RATE,
                                                         prompt_text=PROMPT_TEXT, seed=SEED).tensors())


@pytest.fixture(scope="module")
def native_whole(server) -> np.ndarray:
    return infer(server, "cosyvoice2_offline", synthesis_request(TEXT, prompt_audio=prompt_wav(), prompt_sample_rate=RATE,
                                                                 prompt_text=PROMPT_TEXT, seed=SEED).tensors())


def test_streaming_as_client_grpc_equals_our_cosyvoice2(server, native_stream):
    chunks = stream(server, STREAMING, official_inputs(TEXT, prompt_wav(), PROMPT_TEXT))
    assert len(chunks) > 1 and all(c.shape[0] == 1 and c.ndim == 2 for c in chunks)  # [1, n] each
    assert_same([c.reshape(-1) for c in chunks], native_stream)


def test_padding_past_reference_wav_len_changes_nothing(server, native_stream):
    wav = prompt_wav()
    chunks = stream(server, STREAMING, official_inputs(TEXT, wav, PROMPT_TEXT, padded_to=wav.size + 3 * RATE))
    assert_same([c.reshape(-1) for c in chunks], native_stream)


def test_offline_model_infer_equals_our_cosyvoice2_offline(server, native_whole):
    waveform = infer(server, OFFLINE, official_inputs(TEXT, prompt_wav(), PROMPT_TEXT, padded_to=5 * RATE))
    assert waveform.shape == (1, native_whole.size)
    np.testing.assert_allclose(waveform.reshape(-1), native_whole, rtol=0, atol=ATOL)


def test_kserve_json_as_client_http_returns_the_same_audio(server, native_whole):
    wav = prompt_wav()
    samples = np.zeros((1, 10 * RATE), np.float32)  # client_http pads to whole 10 s
    samples[0, :wav.size] = wav
    body = {"inputs": [
        {"name": "reference_wav", "shape": list(samples.shape), "datatype": "FP32", "data": samples.tolist()},
        {"name": "reference_wav_len", "shape": [1, 1], "datatype": "INT32", "data": [[wav.size]]},
        {"name": "reference_text", "shape": [1, 1], "datatype": "BYTES", "data": [PROMPT_TEXT]},
        {"name": "target_text", "shape": [1, 1], "datatype": "BYTES", "data": [TEXT]},
        {"name": "seed", "shape": [1, 1], "datatype": "UINT64", "data": [[SEED]]}]}
    result = http_post(server, OFFLINE, body)
    audio = np.array(result["outputs"][0]["data"], dtype=np.float32)
    assert result["outputs"][0]["name"] == "waveform" and result["outputs"][0]["shape"] == [1, native_whole.size]
    np.testing.assert_allclose(audio, native_whole, rtol=0, atol=ATOL)


def _voice_store(server):
    from cosyvoice_triton.server.launcher import rendered_parameter
    from cosyvoice_triton.voices.stores import open_voice_store

    return open_voice_store(rendered_parameter(server.model_repository, "cosyvoice2", "voice_store"))


def test_the_spk2info_form_speaks_in_the_registered_default_voice(server):
    import tritonclient.grpc as grpcclient

    # As the gateway registers it at start (gateway/default_voice.py): register_voice with voice_id "default".
    values = RegisterInputs(PromptAudio(prompt_wav(), RATE), PROMPT_TEXT, voice_id=DEFAULT_VOICE_ID).tensors()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer("register_voice", grpc_inputs(values), client_timeout=180)
    assert result.as_numpy("voice_id")[0].decode() == DEFAULT_VOICE_ID
    got = stream(server, STREAMING, official_inputs(TEXT))  # target_text (and seed) alone
    want = stream(server, "cosyvoice2", synthesis_request(TEXT, voice_id=DEFAULT_VOICE_ID, seed=SEED).tensors())
    assert_same([c.reshape(-1) for c in got], want)


def test_the_spk2info_form_without_a_default_voice_is_a_clear_client_error(server):
    store = _voice_store(server)
    try:
        store.delete(DEFAULT_VOICE_ID)
    finally:
        store.close()
    body = {"inputs": [{"name": "target_text", "shape": [1, 1], "datatype": "BYTES", "data": [TEXT]}]}
    with pytest.raises(urllib.error.HTTPError) as answer:
        http_post(server, OFFLINE, body)
    assert answer.value.code == 400
    error = from_wire(json.loads(answer.value.read())["error"])
    assert isinstance(error, InvalidInput) and error.field == "reference_wav" and "'default'" in error.message
    with GrpcStream(server.grpc_url, timeout_s=60) as connection:
        responses = connection.infer(STREAMING, official_inputs(TEXT))
    (failed,) = [r.error for r in responses if r.error]
    assert from_wire(failed).field == "reference_wav"


def test_a_batch_of_two_is_refused_by_name(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    one = official_inputs(TEXT, prompt_wav(), PROMPT_TEXT)
    two = {name: np.concatenate([array, array]) for name, array in one.items()}
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as error:
            client.infer(OFFLINE, grpc_inputs(two), client_timeout=60)
    assert "INVALID_ARGUMENT" in str(error.value.status()) and "batch" in error.value.message()
    assert OFFLINE in error.value.message()
