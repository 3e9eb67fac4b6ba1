"""The Triton layer without Triton: the wire, parameters, templates, metrics, and every model.py
under `pb_fake`, wired together by a BLS handler that plays the server (models in-process)."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.errors import InvalidInput, from_wire
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.llm.scheduler import LLMRequest
from cosyvoice_triton.llm.sampling import SamplingParams
from cosyvoice_triton.token2wav.stream import FlowPrompt
from cosyvoice_triton.token2wav.scheduler import ChunkRequest
from cosyvoice_triton.server.launcher import DEFAULT_REPOSITORY, ServeOptions, repository_values
from cosyvoice_triton.server.templates import model_names, render_template
from cosyvoice_triton.wire.stage_tensors import (StreamCancel, align_prompt_features, chunk_inputs, llm_cancel_inputs,
                                                 llm_inputs, parse_chunk, parse_llm_request, token2wav_cancel_inputs)
from cosyvoice_triton.client.triton_client import synthesis_request
from cosyvoice_triton.wire.requests import PromptAudio, SynthesisInputs, parse_synthesis_inputs
from cosyvoice_triton.errors import ParameterError
from cosyvoice_triton.triton.params import (CosyVoice2Params, LLMParams, PromptStepParams,
                                            RegisterVoiceParams, SpeakerEmbeddingParams, Token2WavParams,
                                            parse_parameters)
from cosyvoice_triton.triton.pb_glue import classify, remote_error
from cosyvoice_triton.wire.tensors import TensorReader, string_array
import pb_fake

REPO = DEFAULT_REPOSITORY
RATE = 16000
PARAMS = {"llm": LLMParams, "token2wav": Token2WavParams, "cosyvoice2": CosyVoice2Params,
          "cosyvoice2_offline": CosyVoice2Params, "cosyvoice2_official": CosyVoice2Params,
          "cosyvoice2_official_offline": CosyVoice2Params, "cosyvoice3": CosyVoice2Params,
          "cosyvoice3_offline": CosyVoice2Params, "cosyvoice3_official": CosyVoice2Params,
          "cosyvoice3_official_offline": CosyVoice2Params, "register_voice": RegisterVoiceParams,
          "prompt_audio": PromptStepParams, "speaker_embedding": SpeakerEmbeddingParams,
          "audio_tokenizer": PromptStepParams}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from cosyvoice_triton.random_folder.write import write_random_model

    return write_random_model(tmp_path_factory.mktemp("units") / "tiny", size="tiny", seed=0)


def model_config(name: str, model_dir: Path, voice_store: str = "/tmp/unused.sqlite", **options) -> dict:
    values = repository_values(ServeOptions(**options), model_dir, voice_store)[name]
    return pb_fake.pbtxt_to_dict(render_template((REPO / name / "config.pbtxt").read_text(), values, name=name))


# ---- templates and parameters ---------------------------------------------------------------------

def test_every_template_renders_and_its_parameters_parse(tmp_path):
    assert set(model_names(REPO)) == set(PARAMS) | {"prompt_encoder"}
    for name in model_names(REPO):
        config = model_config(name, tmp_path, device="cpu")
        assert config["name"] == name
        if name in PARAMS:
            parse_parameters(PARAMS[name], config, name)
    assert model_config("cosyvoice2", tmp_path)["model_transaction_policy"]["decoupled"] is True
    assert model_config("cosyvoice2_offline", tmp_path)["model_transaction_policy"].get("decoupled", False) is False
    assert (REPO / "cosyvoice2_offline" / "config.pbtxt").resolve() == (REPO / "cosyvoice2" / "config.pbtxt").resolve()
    t2w = model_config("token2wav", tmp_path, t2w_max_batch=5)
    assert int(t2w["max_batch_size"]) == 5 and t2w["instance_group"][0]["count"] == 1
    gpu = model_config("llm", tmp_path, device="cuda:1")["instance_group"][0]
    assert gpu["kind"] == "KIND_GPU" and gpu["gpus"] == [1] and gpu["count"] == 1
    assert model_config("token2wav", tmp_path)["instance_group"][0]["kind"] == "KIND_CPU"
    ensemble = model_config("prompt_encoder", tmp_path)
    steps = [step["model_name"] for step in ensemble["ensemble_scheduling"]["step"]]
    assert steps == ["prompt_audio", "speaker_embedding", "audio_tokenizer"]


def test_llm_ratio_is_official_unless_set(tmp_path):
    assert parse_parameters(LLMParams, model_config("llm", tmp_path), "llm").max_token_text_ratio is None
    assert parse_parameters(LLMParams, model_config("llm", tmp_path, max_token_text_ratio=3),
                            "llm").max_token_text_ratio == 3.0


@pytest.mark.parametrize("parameters, problem", [
    ({"model_dir": "m", "voice_store": "", "prompt_encoder_model": "p", "extra": "1"}, "unknown parameters extra"),
    ({"model_dir": "m", "voice_store": ""}, "prompt_encoder_model is missing"),
])
def test_parameters_are_strict(parameters, problem):
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    with pytest.raises(ParameterError, match=problem):
        parse_parameters(RegisterVoiceParams, config, "register_voice")


def test_parameter_types_are_checked():
    config = {"parameters": {k: {"string_value": v} for k, v in {
        "model_dir": "m", "device": "cpu", "max_streams": "many", "max_batch": "2", "idle_timeout_s": "1",
        "flow_cache_frames": "0", "torch_threads": "0", "engine": "torch", "precision": "fp32", "onnx_dir": ""}.items()}}
    with pytest.raises(ParameterError, match="max_streams: 'many' is not a int"):
        parse_parameters(Token2WavParams, config, "token2wav")


# ---- engines ---------------------------------------------------------------------------------------

def test_engine_parameters_are_parsed_and_validated(tmp_path):
    import typing

    from cosyvoice_triton.engines.base import ENGINES, PRECISIONS
    from cosyvoice_triton.engines.cuda_graphs import CUDA_GRAPH_SETTINGS
    from cosyvoice_triton.models.compiled import COMPILE_SETTINGS
    from cosyvoice_triton.triton.params import Engine, OffAutoOn, Precision

    assert typing.get_args(Engine) == ENGINES and typing.get_args(Precision) == PRECISIONS
    assert typing.get_args(OffAutoOn) == COMPILE_SETTINGS == CUDA_GRAPH_SETTINGS
    default = parse_parameters(Token2WavParams, model_config("token2wav", tmp_path), "token2wav")
    assert (default.engine, default.precision, default.onnx_dir) == ("torch", "fp32", None)
    config = model_config("token2wav", tmp_path, engine="onnxruntime", precision="fp16", onnx_dir=tmp_path / "graphs")
    chosen = parse_parameters(Token2WavParams, config, "token2wav")
    assert (chosen.engine, chosen.precision, chosen.onnx_dir) == ("onnxruntime", "fp16", str(tmp_path / "graphs"))
    # CAM++ ships as ONNX: ONNX Runtime on the CPU, unless TensorRT is asked for (then on the server's device).
    campplus = parse_parameters(SpeakerEmbeddingParams, model_config("speaker_embedding", tmp_path, engine="torch"),
                                "speaker_embedding")
    assert (campplus.engine, campplus.device, campplus.onnx_dir) == ("onnxruntime", "cpu", None)
    trt = parse_parameters(SpeakerEmbeddingParams, model_config("speaker_embedding", tmp_path, engine="tensorrt",
                                                                device="cuda:1"), "speaker_embedding")
    assert (trt.engine, trt.device) == ("tensorrt", "cuda:1")

    bad = model_config("token2wav", tmp_path)
    bad["parameters"]["engine"] = {"string_value": "tensorflow"}
    with pytest.raises(ParameterError, match="token2wav: parameter engine: 'tensorflow' is not one of "
                                             "torch, onnxruntime, openvino, tensorrt"):
        parse_parameters(Token2WavParams, bad, "token2wav")
    bad = model_config("token2wav", tmp_path)
    bad["parameters"]["precision"] = {"string_value": "int8"}
    with pytest.raises(ParameterError, match="parameter precision: 'int8' is not one of fp32, fp16, bf16"):
        parse_parameters(Token2WavParams, bad, "token2wav")
    bad = model_config("speaker_embedding", tmp_path)
    bad["parameters"]["engine"] = {"string_value": "torch"}
    with pytest.raises(ParameterError, match="parameter engine: 'torch' is not one of onnxruntime, openvino, "
                                                 "tensorrt"):
        parse_parameters(SpeakerEmbeddingParams, bad, "speaker_embedding")
    with pytest.raises(ValueError, match="engine must be one of torch, onnxruntime, openvino, tensorrt, got 'trt'"):
        model_config("token2wav", tmp_path, engine="trt")


def test_a_read_only_model_folder_exports_into_the_run_folder(tiny, tmp_path, monkeypatch):
    from cosyvoice_triton.server import launcher

    def prepared(**options):
        run_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        server = launcher.prepare(ServeOptions(model_dir=tiny, run_dir=run_dir, voice_store="v.sqlite", **options))
        return pb_fake.pbtxt_to_dict((server.model_repository / "token2wav" / "config.pbtxt").read_text())

    def onnx_dir(config):
        return config["parameters"]["onnx_dir"]["string_value"]

    assert onnx_dir(prepared(engine="onnxruntime")) == ""  # writable: <model_dir>/onnx, the models' default
    assert onnx_dir(prepared(engine="tensorrt", onnx_dir=tmp_path / "mine")) == str(tmp_path / "mine")
    real_access = launcher.os.access
    monkeypatch.setattr(launcher.os, "access", lambda path, mode: False if str(path).startswith(str(tiny))
                        else real_access(path, mode))
    assert onnx_dir(prepared(engine="onnxruntime")) == str(tmp_path / "run2" / "onnx")
    assert onnx_dir(prepared()) == ""  # torch exports nothing


def test_model_files_fall_back_from_tensorrt_with_one_log_line(tiny, tmp_path, caplog):
    """token2wav and speaker_embedding asked for TensorRT on this CPU: ONNX Runtime, one warning line each
    in Triton's log (pb.Logger), the same chunk audio as the torch reference."""
    from cosyvoice_triton.engines.select import build_token2wav
    from cosyvoice_triton.pipeline.local_stages import ReferenceToken2Wav
    from cosyvoice_triton.token2wav.stream import Token2Wav

    values = {"engine": "tensorrt", "onnx_dir": tmp_path / "onnx"}
    with pb_fake.installed() as pb, caplog.at_level(logging.INFO, logger="triton_python_backend_utils.fake"):
        models = {}
        for name in ("token2wav", "speaker_embedding"):
            models[name] = pb_fake.load_model(REPO / name / "1" / "model.py").TritonPythonModel()
            models[name].initialize(pb_fake.initialize_args(model_config(name, tiny, **values)))
        triton_log = [r for r in caplog.records if r.name == "triton_python_backend_utils.fake"]  # pb.Logger
        warnings = [r.getMessage() for r in triton_log if r.levelno == logging.WARNING]
        assert len(warnings) == 2, warnings
        assert warnings[0].startswith("token2wav: cosyvoice_triton.engines.select: engine 'tensorrt' is not "
                                      "available on cpu") and warnings[0].endswith("using 'onnxruntime'")
        assert warnings[1].startswith("speaker_embedding: ") and "'tensorrt'" in warnings[1]
        assert any("exporting the token2wav ONNX graphs" in r.getMessage() for r in triton_log)
        scheduler = models["token2wav"].scheduler
        assert scheduler.flow.decoder.estimator.runner.engine == "onnxruntime"
        assert models["speaker_embedding"].encoder.campplus.engine == "onnxruntime"

        prompt = FlowPrompt(torch.randint(0, 6561, (1, 20), dtype=torch.int32), torch.randn(1, 40, 80),
                            torch.randn(1, 192))
        chunk = ChunkRequest("e0", list(range(10, 40)), False, prompt, seed=5)
        request = pb.InferenceRequest(inputs=[pb.Tensor(k, v) for k, v in chunk_inputs(chunk).items()])
        (response,) = models["token2wav"].execute([request])
        models["token2wav"].finalize()
    want = ReferenceToken2Wav(Token2Wav(*build_token2wav(tiny, "torch"))).chunk(chunk)
    np.testing.assert_allclose(response.outputs()["waveform"][0], want, atol=1e-3, rtol=0)


# ---- the wire -------------------------------------------------------------------------------------

def test_llm_request_round_trip():
    request = LLMRequest("s/0", [5, 6, 7], [1, 2], [10, 11, 12], SamplingParams(top_p=0.5, top_k=7), seed=2**64 - 1)
    parsed = parse_llm_request(TensorReader(llm_inputs(request)), SamplingParams())
    assert parsed == request  # FP32 on the wire; tau_r = 0.1 arrives as 0.1 (RAS compares win_size * tau_r)
    bare = LLMRequest("s/1", [5], [], [], SamplingParams(), seed=3)
    assert parse_llm_request(TensorReader(llm_inputs(bare)), SamplingParams()).prompt_text_tokens == []
    cancel = parse_llm_request(TensorReader(llm_cancel_inputs("s/0")), SamplingParams())
    assert cancel == StreamCancel("s/0")


@pytest.mark.parametrize("changes, field", [
    ({"stream_id": string_array("")}, "stream_id"),
    ({"seed": np.array([-1], np.int64)}, "seed"),
    ({"top_p": np.array([0.0], np.float32)}, "top_p"),
    ({"top_k": np.array([0], np.int32)}, "top_k"),
])
def test_the_llm_parse_is_the_one_check_of_what_arrives(changes, field):
    """Stream id, seed and sampling are checked by the llm model's parse (the scheduler checks only what it alone
    knows: token ids against its vocabularies, the cache)."""
    values = llm_inputs(LLMRequest("s/0", [5], [], [], SamplingParams(), seed=1))
    with pytest.raises(InvalidInput) as caught:
        parse_llm_request(TensorReader({**values, **changes}), SamplingParams())
    assert caught.value.field == field


def test_chunk_round_trip():
    prompt = FlowPrompt(torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.randn(1, 6, 80), torch.randn(1, 192))
    chunk = ChunkRequest("r/0", [4, 5, 6, 7], False, prompt, seed=9)
    parsed = parse_chunk(TensorReader(chunk_inputs(chunk), batched=True))
    assert (parsed.stream_id, parsed.tokens, parsed.finalize, parsed.seed) == ("r/0", [4, 5, 6, 7], False, 9)
    for name in ("speech_tokens", "mel", "embedding"):
        np.testing.assert_array_equal(getattr(parsed.prompt, name), getattr(prompt, name).numpy())  # numpy on the wire
    later = parse_chunk(TensorReader(chunk_inputs(ChunkRequest("r/0", [], True, None, None)),
                                               batched=True))
    assert (later.tokens, later.finalize, later.prompt, later.seed) == ([], True, None, None)
    assert parse_chunk(TensorReader(token2wav_cancel_inputs("r/0"), batched=True)) == \
        StreamCancel("r/0")
    partial = chunk_inputs(chunk)
    del partial["embedding"]
    with pytest.raises(InvalidInput, match="embedding: is required"):
        parse_chunk(TensorReader(partial, batched=True))


def _synthesis(values):
    return parse_synthesis_inputs(TensorReader(values), 2000)


def test_synthesis_inputs_parse():
    wav = speech_like(1.0, RATE)
    inputs = _synthesis(synthesis_request("Hi.", prompt_audio=wav, prompt_sample_rate=RATE, prompt_text="t", seed=4,
                                          mode="cross_lingual", top_k=5, chunk_first_hop=8).tensors())
    assert (inputs.text, inputs.mode, inputs.seed, inputs.prompt_text) == ("Hi.", "cross_lingual", 4, "t")
    assert inputs.audio.sample_rate == RATE and np.array_equal(inputs.audio.samples, wav)
    assert inputs.sampling == {"top_k": 5} and inputs.chunk_overrides == {"first_hop": 8}
    assert _synthesis(synthesis_request("Hi.", voice_id="v1").tensors()).voice_id == "v1"


@pytest.mark.parametrize("values, field", [
    (lambda: synthesis_request(" ", voice_id="v").tensors(), "target_text"),
    (lambda: SynthesisInputs("Hi.").tensors(), "reference_wav"),
    (lambda: SynthesisInputs("Hi.", voice_id="v", audio=PromptAudio(np.ones(8), RATE)).tensors(), "reference_audio_id"),
    (lambda: {**synthesis_request("Hi.", prompt_audio=np.ones(8), prompt_sample_rate=RATE).tensors()} | {
        "reference_sample_rate": np.array([0], np.int32)}, "reference_sample_rate"),
    (lambda: {"target_text": string_array("Hi."), "reference_wav": np.ones(8, np.float32)}, "reference_sample_rate"),
    (lambda: synthesis_request("Hi.", voice_id="v", mode="sing").tensors(), "mode"),
    (lambda: synthesis_request("Hi.", voice_id="v", top_p=2.0).tensors(), "top_p"),
    (lambda: {"target_text": np.array([b"\xff"], dtype=object), "reference_audio_id": string_array("v")},
     "target_text"),
    (lambda: {"target_text": string_array(["a", "b"]), "reference_audio_id": string_array("v")}, "target_text"),
])
def test_synthesis_input_errors_name_the_field(values, field):
    with pytest.raises(InvalidInput) as error:
        _synthesis(values())
    assert error.value.field == field


def test_tensor_reader_checks_dtypes_and_batches():
    reader = TensorReader({"a": np.array([[1.5]], np.float32), "b": np.array([1, 2], np.int32)}, batched=True)
    assert reader.real("a") == 1.5
    with pytest.raises(InvalidInput, match="b: expected a batch of one request"):
        reader.raw("b")
    with pytest.raises(InvalidInput, match="must be INT32, got FP64"):
        TensorReader({"t": np.ones(3)}).token_ids("t")
    with pytest.raises(InvalidInput, match="x: must be BOOL, got INT32"):
        TensorReader({"x": np.array([1], np.int32)}).boolean("x")


def test_errors_map_to_triton_codes():
    from cosyvoice_triton.errors import Cancelled, NotFound, Unavailable

    assert classify(InvalidInput("f", "bad")).code_name == "INVALID_ARG"
    assert classify(NotFound("reference_audio_id", "no")).code_name == "NOT_FOUND"
    assert classify(Cancelled("gone")).code_name == "CANCELLED"
    assert classify(Unavailable("busy")).code_name == "UNAVAILABLE"
    assert classify(remote_error("llm", "stream_id: x", 3)).code_name == "INVALID_ARG"
    assert classify(remote_error("llm", Unavailable("full", retry_after_s=2).to_wire(), 4)).code_name == "UNAVAILABLE"
    assert classify(ValueError("oops")).code_name == "INTERNAL"


def test_align_prompt_features_matches_the_prompt_encoder(tiny):
    from cosyvoice_triton.preprocess.prompt import PromptEncoder
    from cosyvoice_triton.preprocess.voice_features import audio_sha256

    encoder = PromptEncoder.from_model_dir(tiny)
    wav = speech_like(1.3, RATE, seed=3)
    want = encoder.encode(wav, RATE, "t")
    got = align_prompt_features(encoder.speaker_embedding(wav), encoder.speech_tokens(wav),
                                          encoder.prompt_mel(wav, RATE), "t", audio_sha256(wav, RATE))
    for name in ("embedding", "speech_tokens", "mel"):
        assert np.array_equal(getattr(got, name), getattr(want, name))
    assert got.audio_sha256 == want.audio_sha256


# ---- metrics and decoupled responses --------------------------------------------------------------------------

def test_model_metrics_follow_engine_counters():
    from cosyvoice_triton.triton.metrics import LLM_METRICS, ModelMetrics

    with pb_fake.installed() as pb:
        metrics = ModelMetrics(pb, LLM_METRICS, {"model": "llm", "instance": "llm_0_0"})
        metrics.follow_counter("ended", 3, "max_len")
        metrics.follow_counter("ended", 5, "max_len")
        metrics.follow_counter("ended", 4, "max_len")  # an older reading never takes a counter back
        metrics.set_gauges(lambda: {"active": 2, "tps": 10.5})
        assert metrics.labelled("ended", "max_len").value() == 5
        assert metrics["active"].value() == 2 and metrics["tps"].value() == 10.5
        family = pb.MetricFamily.registry["cosyvoice_llm_streams_total"]
        assert {m.labels["reason"] for m in family.metrics} == {"stop_token", "max_len", "cancelled", "error"}


def test_send_chunks_stops_the_producer_on_cancel_and_sends_one_final():
    from cosyvoice_triton.triton.decoupled import send_chunks

    closed = []

    def produce():
        try:
            for i in range(10):
                yield np.full(4, i, np.float32)
        finally:
            closed.append(True)

    with pb_fake.installed() as pb:
        request = pb.InferenceRequest()
        sent = []

        def cancel_after_two():
            sent.append(1)
            if len(sent) > 2:
                request.cancel()
            return request.is_cancelled()

        outcome = send_chunks(pb, request.sender, produce, model="m", received_at=0.0, is_cancelled=cancel_after_two)
        responses = request.sender.wait_final(1)
    assert outcome == "cancelled" and closed == [True]
    assert [r.outputs()["waveform"][0] for r in responses[:-1]] == [0.0, 1.0]
    assert responses[-1].error().code() == pb_fake.TritonError.CANCELLED
    assert sum(flags for _, flags in request.sender.sent) == pb_fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def test_send_chunks_reports_an_error_in_the_final_response():
    from cosyvoice_triton.triton.decoupled import send_chunks

    def produce():
        yield np.zeros(3, np.float32)
        raise InvalidInput("target_text", "bad")

    with pb_fake.installed() as pb:
        request = pb.InferenceRequest()
        assert send_chunks(pb, request.sender, produce, model="m", received_at=0.0) == "error"
        responses = request.sender.wait_final(1)
    assert responses[0].outputs()["waveform"].shape == (3,)
    sent = from_wire(responses[1].error().message())  # the error as data (CosyVoiceError.to_wire)
    assert (type(sent), sent.field, sent.message) == (InvalidInput, "target_text", "target_text: bad")
    assert responses[1].error().code() == pb_fake.TritonError.INVALID_ARG


# ---- the model files, wired by a fake BLS -----------------------------------------------------------

class FakeServer:
    """Loads model.py files under pb_fake and answers their BLS calls like Triton would."""

    def __init__(self, pb, tiny: Path, store: str, **options):
        self.pb = pb
        self.models = {}
        self.calls: Counter[str] = Counter()  # BLS calls by model name
        for name in ("llm", "token2wav", "prompt_audio", "speaker_embedding", "audio_tokenizer", "cosyvoice2",
                     "cosyvoice2_offline", "register_voice"):
            module = pb_fake.load_model(REPO / name / "1" / "model.py")
            model = module.TritonPythonModel()
            model.initialize(pb_fake.initialize_args(model_config(name, tiny, store, max_token_text_ratio=3,
                                                                  workers=2, max_pending=0, **options)))
            self.models[name] = model
        pb.set_bls_handler(self.handle)

    def call(self, name: str, inputs: dict[str, np.ndarray]):
        request = self.pb.InferenceRequest(model_name=name, inputs=[self.pb.Tensor(k, v) for k, v in inputs.items()])
        return self.handle(request, decoupled=False)

    def handle(self, request, decoupled: bool):
        name = request.model_name()
        self.calls[name] += 1
        inner = self.pb.InferenceRequest(model_name=name, inputs=request.inputs())
        if name == "prompt_encoder":  # the ensemble: prompt_audio, then both steps on its wav16k
            step1 = self.call("prompt_audio", {t.name(): t.as_numpy() for t in request.inputs()})
            if step1.has_error():
                return step1
            out = step1.outputs()
            embedding = self.call("speaker_embedding", {"wav16k": out["wav16k"]}).outputs()["embedding"]
            tokens = self.call("audio_tokenizer", {"wav16k": out["wav16k"]}).outputs()["speech_tokens"]
            return self.pb.InferenceResponse(output_tensors=[
                self.pb.Tensor("embedding", embedding), self.pb.Tensor("speech_tokens", tokens),
                self.pb.Tensor("prompt_mel", out["prompt_mel"])])
        model = self.models[name]
        returned = model.execute([inner])
        if decoupled:
            return inner.sender.wait_final(60) + [self.pb.InferenceResponse()]
        if returned is None:  # answered through the response sender (cosyvoice2_offline)
            (response,) = inner.sender.wait_final(60)
            return response
        return returned[0]

    def close(self):
        for model in self.models.values():
            if hasattr(model, "finalize"):
                model.finalize()


@pytest.fixture(scope="module")
def fake(tiny, tmp_path_factory):
    with pb_fake.installed() as pb:
        server = FakeServer(pb, tiny, str(tmp_path_factory.mktemp("store") / "voices.sqlite"))
        yield server
        server.close()


@pytest.fixture(scope="module")
def reference(tiny):
    from cosyvoice_triton.pipeline.local_stages import ReferenceLLM, ReferenceToken2Wav
    from cosyvoice_triton.pipeline.pipeline import Pipeline
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2

    tts = CosyVoice2.from_model_dir(tiny)
    tts.llm.config.max_token_text_ratio = 3
    return tts, Pipeline(tts.preprocessor, ReferenceLLM(tts.llm), ReferenceToken2Wav(tts.token2wav))


def _reference_chunks(reference, text, wav, seed, stream=True):
    from cosyvoice_triton.messages import SynthesisRequest

    tts, pipeline = reference
    request = SynthesisRequest(text=text, voice=tts.encode_voice(wav, RATE, "a prompt"), seed=seed,
                               sampling=tts.llm.config.sampling)
    return [c for c in pipeline.run(request, stream=stream) if c.size]


def test_cosyvoice2_streams_what_the_library_streams(fake, reference):
    wav = speech_like(1.5, RATE, seed=1)
    text = "Hello there, this is the fake server. A second sentence is here."
    request = fake.pb.InferenceRequest(inputs=[fake.pb.Tensor(k, v) for k, v in synthesis_request(
        text, prompt_audio=wav, prompt_sample_rate=RATE, prompt_text="a prompt", seed=7).tensors().items()])
    assert fake.models["cosyvoice2"].execute([request]) is None
    got = [r.outputs()["waveform"] for r in request.sender.wait_final(120)]
    want = _reference_chunks(reference, text, wav, 7)
    assert [c.size for c in got] == [c.size for c in want]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=2e-4, rtol=0)
    metrics = fake.models["cosyvoice2"].metrics
    assert metrics.labelled("requests", "ok").value() >= 1 and metrics["active"].value() == 0
    assert fake.models["token2wav"].scheduler.stats.active_streams == 0
    assert fake.models["llm"].scheduler.stats.active_streams == 0
    # what the models compute in, as /readyz reads it from their metrics (ServeOptions: fp32 both)
    assert fake.models["llm"].metrics.labelled("precision", "fp32").value() == 1
    assert fake.models["llm"].metrics.labelled("precision", "int8").value() == 0
    assert fake.models["token2wav"].metrics.labelled("precision", "fp32").value() == 1


def test_the_quick_chunk_preset_streams_what_the_library_streams_with_it(fake, reference, tiny, tmp_path):
    """serve --chunk-preset quick: cosyvoice2's requests start with a 15-token hop and token2wav makes each last
    chunk as a cached streaming call; the library with the same preset makes the same audio, and its first
    chunk comes sooner (fewer samples) than the official schedule's."""
    from dataclasses import replace as copy_with

    from cosyvoice_triton.messages import SynthesisRequest
    from cosyvoice_triton.models.flow_cache import FlowCacheSettings
    from cosyvoice_triton.pipeline.chunk_policy import CHUNK_PRESETS
    from cosyvoice_triton.pipeline.local_stages import ReferenceLLM, ReferenceToken2Wav
    from cosyvoice_triton.pipeline.pipeline import Pipeline
    from cosyvoice_triton.token2wav.stream import Token2Wav

    wav, text = speech_like(1.5, RATE, seed=2), "The quick preset speaks sooner. It has a second sentence too."
    tts, official = reference
    quick = CHUNK_PRESETS["quick"]
    token2wav = Token2Wav(tts.token2wav.flow, tts.token2wav.hift, FlowCacheSettings(cached_final=True))
    pipeline = Pipeline(tts.preprocessor, ReferenceLLM(tts.llm), ReferenceToken2Wav(token2wav))
    request = SynthesisRequest(text=text, voice=tts.encode_voice(wav, RATE, "a prompt"), seed=5,
                               sampling=tts.llm.config.sampling)
    want = [c for c in pipeline.run(copy_with(request, chunk_policy=quick.policy()), stream=True) if c.size]
    official_chunks = [c for c in official.run(request, stream=True) if c.size]
    assert want[0].size < official_chunks[0].size
    pb = fake.pb  # a second server on the installed fake pb_utils; its BLS calls go to it while it runs
    server = FakeServer(pb, tiny, str(tmp_path / "voices.sqlite"), chunk_preset="quick")
    try:
        assert server.models["token2wav"].scheduler.flow_cache.cached_final
        call = pb.InferenceRequest(inputs=[pb.Tensor(k, v) for k, v in synthesis_request(
            text, prompt_audio=wav, prompt_sample_rate=RATE, prompt_text="a prompt", seed=5).tensors().items()])
        assert server.models["cosyvoice2"].execute([call]) is None
        got = [r.outputs()["waveform"] for r in call.sender.wait_final(120)]
    finally:
        server.close()
        pb.set_bls_handler(fake.handle)  # back to the module's server
    assert [c.size for c in got] == [c.size for c in want]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=2e-4, rtol=0)


def test_offline_twin_and_registered_voices(fake, reference):
    wav = speech_like(1.25, RATE, seed=2)
    answer = fake.call("register_voice", {"reference_wav": wav, "reference_sample_rate": np.array([RATE], np.int32),
                                          "reference_text": string_array("a prompt")})
    voice_id = answer.outputs()["voice_id"][0].decode()
    encoded = fake.calls["prompt_encoder"]
    again = fake.call("register_voice", {"reference_wav": wav, "reference_sample_rate": np.array([RATE], np.int32),
                                         "reference_text": string_array("a prompt")})
    assert again.outputs()["voice_id"][0].decode() == voice_id
    assert fake.calls["prompt_encoder"] == encoded  # found by content key: the encoder did not run again
    other = fake.call("register_voice", {"reference_wav": wav, "reference_sample_rate": np.array([RATE], np.int32),
                                         "reference_text": string_array("another transcript")})
    assert other.outputs()["voice_id"][0].decode() != voice_id  # same audio, new transcript: a new voice
    assert fake.calls["prompt_encoder"] == encoded + 1
    text = "Offline, by voice id."
    response = fake.call("cosyvoice2_offline", synthesis_request(text, voice_id=voice_id, seed=3).tensors())
    want = np.concatenate(_reference_chunks(reference, text, wav, 3, stream=False))
    np.testing.assert_allclose(response.outputs()["waveform"], want, atol=2e-4, rtol=0)
    missing = fake.call("cosyvoice2_offline", synthesis_request(text, voice_id="nobody").tensors())
    assert missing.error().code() == pb_fake.TritonError.NOT_FOUND and "reference_audio_id" in missing.error().message()


def test_bad_requests_get_errors_naming_the_field(fake):
    request = fake.pb.InferenceRequest(inputs=[fake.pb.Tensor("target_text", string_array(""))])
    fake.models["cosyvoice2"].execute([request])
    (response,) = request.sender.wait_final(5)
    assert response.error().code() == pb_fake.TritonError.INVALID_ARG
    assert from_wire(response.error().message()).field == "target_text", response.error().message()
    silent = fake.call("register_voice", {"reference_wav": np.zeros(RATE, np.float32),
                                          "reference_sample_rate": np.array([RATE], np.int32)})
    assert from_wire(silent.error().message()).field == "reference_wav"


def test_cosyvoice2_refuses_beyond_its_pool(fake):
    model = fake.models["cosyvoice2"]
    gate = threading.Event()
    blockers = [model.pool.try_submit(gate.wait) for _ in range(2)]  # workers=2, max_pending=0
    try:
        assert blockers == [True, True]
        request = fake.pb.InferenceRequest(inputs=[fake.pb.Tensor(k, v) for k, v in synthesis_request(
            "Hi.", voice_id="nobody").tensors().items()])
        model.execute([request])
        (response,) = request.sender.wait_final(5)
        assert response.error().code() == pb_fake.TritonError.UNAVAILABLE
    finally:
        gate.set()


def test_llm_model_cancel_by_stream_id(fake):
    llm = fake.models["llm"]
    request = fake.pb.InferenceRequest(inputs=[fake.pb.Tensor(k, v) for k, v in llm_inputs(
        LLMRequest("long/0", list(range(5, 600)), [], [], SamplingParams(), seed=1)).items()])
    llm.execute([request])
    cancel = fake.pb.InferenceRequest(inputs=[fake.pb.Tensor(k, v)
                                              for k, v in llm_cancel_inputs("long/0").items()])
    llm.execute([cancel])
    assert cancel.sender.wait_final(5) == []
    tokens = sum(r.outputs()["speech_tokens"].size for r in request.sender.wait_final(30))
    assert tokens < 3 * 595  # ended early
    assert llm.metrics.labelled("ended", "cancelled").value() >= 1
    assert llm.scheduler.stats.slots_free == llm.scheduler.max_batch


def test_token2wav_model_batches_streams_and_frees_them(fake, reference):
    tts, _ = reference
    model = fake.models["token2wav"]
    prompts = [FlowPrompt(torch.randint(0, 6561, (1, p), dtype=torch.int32), torch.randn(1, 2 * p, 80),
                          torch.randn(1, 192)) for p in (20, 33)]
    first = [ChunkRequest(f"t{i}", list(range(10 + i, 40 + i)), False, prompt, seed=i) for i, prompt in enumerate(prompts)]

    def run(chunks):
        requests = [fake.pb.InferenceRequest(inputs=[fake.pb.Tensor(k, v) for k, v in chunk_inputs(c).items()])
                    for c in chunks]
        return [r.outputs()["waveform"][0] if not r.has_error() else r.error() for r in model.execute(requests)]

    from cosyvoice_triton.pipeline.local_stages import ReferenceToken2Wav

    solo = ReferenceToken2Wav(tts.token2wav)
    got = run(first)
    for chunk, audio in zip(first, got):
        np.testing.assert_allclose(audio, solo.chunk(chunk), atol=2e-4, rtol=0)
    assert model.scheduler.stats.active_streams == 2
    cancel = fake.pb.InferenceRequest(inputs=[fake.pb.Tensor(k, v)
                                              for k, v in token2wav_cancel_inputs("t1").items()])
    final = fake.pb.InferenceRequest(inputs=[fake.pb.Tensor(k, v) for k, v in chunk_inputs(
        ChunkRequest("t0", [3, 4, 5], True, None, None)).items()])
    responses = model.execute([final, cancel])
    np.testing.assert_allclose(responses[0].outputs()["waveform"][0],
                               solo.chunk(ChunkRequest("t0", [3, 4, 5], True, None, None)), atol=2e-4, rtol=0)
    assert responses[1].outputs()["waveform"].shape == (1, 0)
    assert model.scheduler.stats.active_streams == 0
    assert model.metrics.labelled("freed", "cancel").value() >= 1
    unknown = run([ChunkRequest("t9", [1, 2, 3, 4, 5, 6, 7, 8], False, None, None)])[0]
    assert unknown.code() == pb_fake.TritonError.NOT_FOUND and "stream_id" in unknown.message()


class _MetricCalls:
    """Stands in for metrics._METRIC_LOCK (every metric operation takes it): records the threads that
    touch metrics outside an execute."""

    def __init__(self):
        self._lock = threading.RLock()
        self.in_execute = threading.local()
        self.outside: list[str] = []

    def __enter__(self):
        self._lock.acquire()
        if not getattr(self.in_execute, "flag", False):
            self.outside.append(threading.current_thread().name)

    def __exit__(self, *exc):
        self._lock.release()


@pytest.mark.parametrize("frames", [0, 300])
def test_token2wav_flow_cache_frames_reach_its_scheduler(tiny, frames):
    """serve/up --flow-cache-frames N: the served token2wav keeps at most N frames per stream; 0 turns the
    cache off (the scheduler then re-runs the flow over every token at each chunk)."""
    with pb_fake.installed():
        module = pb_fake.load_model(REPO / "token2wav" / "1" / "model.py")
        model = module.TritonPythonModel()
        model.initialize(pb_fake.initialize_args(model_config("token2wav", tiny, flow_cache_frames=frames)))
        try:
            settings = model.scheduler.flow_cache
            assert (settings is None) if frames == 0 else (settings.max_frames == frames)
        finally:
            model.finalize()


def test_token2wav_idle_frees_reach_the_metrics_through_execute_only(tiny, monkeypatch):
    from cosyvoice_triton.triton import metrics as metrics_module

    with pb_fake.installed() as pb:
        module = pb_fake.load_model(REPO / "token2wav" / "1" / "model.py")
        model = module.TritonPythonModel()
        model.initialize(pb_fake.initialize_args(model_config("token2wav", tiny, t2w_idle_timeout_s=0.2)))
        calls = _MetricCalls()
        monkeypatch.setattr(metrics_module, "_METRIC_LOCK", calls)
        executed = []

        def execute(requests):  # as Triton runs it: the requests of one batch, metrics allowed
            calls.in_execute.flag = True
            try:
                executed.append(len(requests))
                return model.execute(requests)
            finally:
                calls.in_execute.flag = False

        def bls(request, decoupled):
            assert request.model_name() == "token2wav" and not decoupled
            return execute([pb.InferenceRequest(model_name="token2wav", inputs=request.inputs())])[0]

        pb.set_bls_handler(bls)
        try:
            prompt = FlowPrompt(torch.randint(0, 6561, (1, 20), dtype=torch.int32), torch.randn(1, 40, 80),
                                torch.randn(1, 192))
            chunk = ChunkRequest("left-open", list(range(10, 40)), False, prompt, seed=0)
            (response,) = execute([pb.InferenceRequest(inputs=[pb.Tensor(k, v) for k, v in
                                                               chunk_inputs(chunk).items()])])
            assert response.outputs()["waveform"].size > 0
            assert model.metrics["active"].value() == 1
            deadline = time.monotonic() + 30
            while model.metrics.labelled("freed", "idle").value() < 1:  # the timer frees it, nobody calls
                assert time.monotonic() < deadline, "idle stream not freed in the metrics"
                time.sleep(0.05)
            assert model.scheduler.stats.freed["idle"] == 1 and model.metrics["active"].value() == 0
            assert executed == [1, 1]  # the chunk, then the timer's no-op request
            batch = pb.MetricFamily.registry["cosyvoice_token2wav_batch_size"].metrics[0]
            assert batch.observations == [1.0]  # the no-op request is not counted as traffic
            # No metric was touched outside execute but by this test's own reads.
            assert set(calls.outside) <= {threading.current_thread().name}, calls.outside
        finally:
            model.finalize()


ORCHESTRATING_MODELS = ("cosyvoice2", "cosyvoice2_offline", "cosyvoice2_official", "cosyvoice2_official_offline",
                        "register_voice")
_IMPORT_WITHOUT_TRITON = """
import importlib.util, sys, types
pb = types.ModuleType("triton_python_backend_utils")
pb.__file__ = "pb_utils.py"
pb.__getattr__ = lambda name: object()  # module-level constants only; nothing runs before initialize()
sys.modules[pb.__name__] = pb
spec = importlib.util.spec_from_file_location("model", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(" ".join(sorted(m for m in ("torch", "onnxruntime", "transformers") if m in sys.modules)))
"""


@pytest.mark.parametrize("model", ORCHESTRATING_MODELS)
def test_orchestrating_models_load_without_torch(model) -> None:
    """The models that only orchestrate (text, voices, BLS calls) never import torch: each of a server's
    stubs is its own process, and torch's import is most of a stub's start-up on a small CPU."""
    import subprocess
    import sys

    path = REPO / model / "1" / "model.py"
    done = subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT_TRITON, str(path)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []
