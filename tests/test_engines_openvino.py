"""OpenVINO on this CPU: the exported graphs compiled by the OpenVINO runtime against the torch reference,
token2wav built with `engine="openvino"`, CAM++ against its golden output, precision checks and the
fallback when OpenVINO cannot run.

Tolerances are the ONNX Runtime ones of test_engines_onnx.py (1e-4 flow graphs and mels, 1e-5 HiFT
decode, 1e-3 waveforms, 1e-4 CAM++): OpenVINO runs the same fp32 graphs, with its own kernels.
"""
from __future__ import annotations

import logging

import pytest
import torch

from cosyvoice_triton.engines.base import RunnerModule
from cosyvoice_triton.errors import EngineUnavailable
from cosyvoice_triton.engines.onnx_export import token2wav_onnx
from cosyvoice_triton.engines.onnx_graphs import example_inputs, token2wav_specs
from cosyvoice_triton.engines.select import RunnerHiFT, build_token2wav, open_campplus, resolve_engine
from cosyvoice_triton.engines.torch_runner import TorchRunner
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.token2wav.stream import Token2Wav
from cosyvoice_triton.token2wav.scheduler import ChunkRequest, Token2WavScheduler
from test_engines_onnx import GRAPH_TOL, MEL_TOL, WAVE_TOL, golden_flow_call, golden_prompt, report

openvino = pytest.importorskip("openvino", reason="the openvino extra is not installed")
from cosyvoice_triton.engines.openvino_runner import OpenVINORunner, compile_config  # noqa: E402


@pytest.fixture(scope="module", params=["tiny", "golden"])
def folder(request, tmp_path_factory):
    model_dir = request.getfixturevalue(f"{request.param}_model_dir")
    return request.param, model_dir, token2wav_onnx(model_dir, tmp_path_factory.mktemp(f"ov_{request.param}"))


@pytest.fixture(scope="module")
def golden_onnx_dir(golden_model_dir, tmp_path_factory):
    onnx_dir = tmp_path_factory.mktemp("ov_golden_e2e")
    token2wav_onnx(golden_model_dir, onnx_dir)
    return onnx_dir


@pytest.mark.parametrize("name, streaming", [("flow_encoder", False), ("flow_encoder", True),
                                             ("flow_estimator", False), ("flow_estimator", True),
                                             ("hift_decode", False)])
def test_openvino_matches_torch(folder, name: str, streaming: bool):
    label, model_dir, paths = folder
    flow, hift = FlowModel.from_model_dir(model_dir), HiFTGenerator.from_model_dir(model_dir)
    spec = token2wav_specs(flow.config)[name]
    reference = {"flow_encoder": flow.encoder, "flow_estimator": flow.decoder.estimator, "hift_decode": hift.decode}
    runner = OpenVINORunner(paths[name], spec, "cpu")
    for batch, frames in ((3, 110), (1, 37)):  # two shapes on one compiled model: the axes stay dynamic
        inputs = list(example_inputs(name, flow.config, hift.config, batch=batch, frames=frames))
        if "streaming" in spec.inputs:
            index = spec.inputs.index("streaming")
            inputs[index] = torch.full_like(inputs[index], streaming)
        expected = TorchRunner(reference[name], spec, "cpu")(*inputs)
        report(f"{label} {name} streaming={streaming} B={batch} T={frames}, openvino vs torch", runner(*inputs),
               expected, GRAPH_TOL[name])


def test_flow_mel_with_openvino(golden_model_dir, golden_onnx_dir, golden):
    flow, hift = build_token2wav(golden_model_dir, "openvino", onnx_dir=golden_onnx_dir)
    assert isinstance(flow.encoder, RunnerModule) and flow.decoder.estimator.runner.engine == "openvino"
    assert isinstance(hift, RunnerHiFT) and hift.decode_runner.engine == "openvino"
    n_all = golden["flow_token"].shape[1]
    report("flow mel offline, openvino vs official", golden_flow_call(flow, golden, n_all, True),
           golden["flow_mel_nonstream"], MEL_TOL)
    for chunk, end in enumerate(golden["flow_stream_chunk_token_ends"]):
        report(f"flow mel streaming chunk {chunk}, openvino vs official",
               golden_flow_call(flow, golden, int(end), False), golden[f"flow_mel_stream_chunk{chunk}"], MEL_TOL)


def test_token2wav_audio_and_batches_with_openvino(golden_model_dir, golden_onnx_dir, golden):
    """Offline audio against the official output; two streams batched into one flow call against torch."""
    token2wav = {engine: Token2Wav(*build_token2wav(golden_model_dir, engine, onnx_dir=golden_onnx_dir))
                 for engine in ("torch", "openvino")}
    tokens = golden["flow_token"][0].tolist()
    offline = token2wav["openvino"].stream(golden_prompt(golden), ZeroNoise()).chunk(tokens, finalize=True)
    report("token2wav offline, openvino vs official", offline, golden["e2e_nonstream"][0], WAVE_TOL)
    results = {}
    for engine, pipeline in token2wav.items():
        batcher = Token2WavScheduler(pipeline.flow, pipeline.hift)
        first = [ChunkRequest(sid, tokens[:30 + 5 * k], False, golden_prompt(golden), seed=7 + k)
                 for k, sid in enumerate(["a", "b"])]
        final = [ChunkRequest(sid, tokens[30 + 5 * k:], True, None, None) for k, sid in enumerate(["a", "b"])]
        results[engine] = batcher.run(first) + batcher.run(final)
        assert batcher.stats.max_flow_batch == 2 and batcher.stats.active_streams == 0
    for i, (ov_audio, torch_audio) in enumerate(zip(results["openvino"], results["torch"], strict=True)):
        report(f"Token2WavScheduler chunk {i}, openvino vs torch", ov_audio, torch_audio, WAVE_TOL)


def test_campplus_on_openvino(golden_model_dir, golden, caplog):
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton"):
        runner = open_campplus(golden_model_dir, "openvino", "cpu")
    assert runner.engine == "openvino" and not caplog.records
    for rows in (1, 3):  # the batch axis is dynamic
        fbank = torch.from_numpy(golden["onnx_campplus_in"]).repeat(rows, 1, 1)
        report(f"campplus openvino B={rows} vs golden", runner(fbank), golden["onnx_campplus_out"].repeat(rows, 0),
               1e-4)


def test_precisions_this_cpu_lacks_are_a_clear_error(folder):
    """fp32 always; bf16 / fp16 only where OpenVINO's CPU plugin lists them (AVX512-BF16, AMX)."""
    _, model_dir, paths = folder
    core = openvino.Core()
    capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    assert compile_config(core, "CPU", "fp32", 2)["INFERENCE_PRECISION_HINT"] == "f32"
    spec = token2wav_specs(FlowModel.from_model_dir(model_dir).config)["hift_decode"]
    for precision, capability in (("bf16", "BF16"), ("fp16", "FP16")):
        if capability in capabilities:
            assert OpenVINORunner(paths["hift_decode"], spec, precision=precision).precision == precision
        else:
            with pytest.raises(EngineUnavailable, match=f"cannot compute in {precision}: it offers .*FP32"):
                OpenVINORunner(paths["hift_decode"], spec, precision=precision)
    if "NPU" not in core.available_devices:
        with pytest.raises(EngineUnavailable, match="no device 'NPU'"):
            compile_config(core, "NPU", "fp32", 1)
    with pytest.raises(ValueError, match="precision must be one of"):
        compile_config(core, "CPU", "int4", 1)


def test_openvino_missing_falls_back_to_onnxruntime_with_one_log_line(tiny_model_dir, tmp_path, monkeypatch,
                                                                      caplog):
    import cosyvoice_triton.engines.openvino_runner as openvino_runner

    monkeypatch.setattr(openvino_runner, "openvino_unavailable_reason", lambda: "the openvino package is not installed")
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton"):
        assert resolve_engine("openvino", "cpu") == "onnxruntime"
        flow, hift = build_token2wav(tiny_model_dir, "openvino", "cpu", onnx_dir=tmp_path)
        campplus = open_campplus(tiny_model_dir, "openvino", "cpu")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3 and all("openvino package is not installed" in w for w in warnings), warnings
    assert flow.decoder.estimator.runner.engine == "onnxruntime" and hift.decode_runner.engine == "onnxruntime"
    assert campplus.engine == "onnxruntime"


def test_in_process_synthesis_on_openvino_matches_torch(tiny_model_dir, prompt_wav_16k, tmp_path):
    """`CosyVoice2.from_model_dir(engine="openvino")`: CAM++ and token2wav on OpenVINO, the LLM in torch;
    same voice features (to 1e-4) and the same streamed audio as the torch pipeline for one seed."""
    import numpy as np

    from cosyvoice_triton.messages import SynthesisRequest
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2

    samples, rate = prompt_wav_16k
    audio, voices = {}, {}
    for engine in ("torch", "openvino"):
        tts = CosyVoice2.from_model_dir(tiny_model_dir, engine=engine, onnx_dir=tmp_path)
        voices[engine] = tts.encode_voice(samples, rate, "今天天气真不错")
        # the torch voice for both: the audio compares token2wav alone, the embeddings are compared below
        request = SynthesisRequest(text="你好。今天天气真不错。", voice=voices["torch"], seed=5)
        audio[engine] = list(tts.synthesize(request, stream=True))
    assert tts.prompt_encoder.campplus.engine == "openvino"
    assert tts.token2wav.flow.decoder.estimator.runner.engine == "openvino"
    report("CAM++ embedding, openvino vs onnxruntime", voices["openvino"].embedding, voices["torch"].embedding, 1e-4)
    assert len(audio["torch"]) >= 2 and [c.size for c in audio["openvino"]] == [c.size for c in audio["torch"]]
    report("streamed audio, openvino vs torch", np.concatenate(audio["openvino"]), np.concatenate(audio["torch"]),
           WAVE_TOL)


# ---- end to end through a real tritonserver started as `serve --engine openvino` ----

from test_triton_engines import (assert_same_audio, engine_model, log_lines, prepared, prompt,  # noqa: E402,F401
                                 reference_chunks, streamed)


@pytest.fixture(scope="module")
def openvino_server(engine_model, tmp_path_factory):
    server = prepared(engine_model, tmp_path_factory.mktemp("serve_openvino"), "openvino")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_openvino_server_streams_the_torch_audio(openvino_server, prompt, reference_chunks):
    """token2wav and CAM++ on OpenVINO in tritonserver: the torch pipeline's audio (1e-3, as ONNX Runtime)."""
    assert_same_audio(streamed(openvino_server, prompt), reference_chunks)
    assert len(log_lines(openvino_server, r"token2wav: .*token2wav on openvino \(cpu\)")) == 1
    assert not log_lines(openvino_server, r"is not available")


# ---- the OpenVINO container variant (static checks, as tests/test_deploy_manifests.py does) ----

def test_openvino_dockerfile_variant():
    import json
    import re
    import shutil
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    from test_deploy_manifests import ROOT, _check_command

    path = ROOT / "deploy" / "docker" / "openvino.Dockerfile"
    text = path.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    cmd = json.loads(next(ln for ln in lines if ln.startswith("CMD "))[4:])
    assert cmd[cmd.index("--engine") + 1] == "openvino" and cmd[cmd.index("--device") + 1] == "cpu"
    _check_command(cmd, None, "openvino.Dockerfile CMD")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert re.search(r'pip install .*-e "\.\[serve,openvino\]"', text) and any(
        dep.startswith("openvino") for dep in extras["openvino"])
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if Path(exe).exists():
        result = subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr


def test_engine_compare_report_on_the_tiny_folder(tiny_model_dir, tmp_path):
    """perf/engine_compare.py end to end on the tiny folder, one round: every graph on every engine, with
    its error against the reference, and the streamed pipelines on torch, onnxruntime and openvino."""
    from cosyvoice_triton.perf import engine_compare

    out = tmp_path / "report.md"
    assert engine_compare.main(["--model-dir", str(tiny_model_dir), "--onnx-dir", str(tmp_path / "onnx"),
                                "--rounds", "1", "--e2e-rounds", "1", "--seconds", "1", "--threads", "1",
                                "--out", str(out)]) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ")]
    engines = {(row[0][2:].split(" (")[0], row[1]) for row in rows}
    for graph in ("flow_encoder", "flow_estimator", "hift_decode"):
        assert {(graph, "torch"), (graph, "onnxruntime CPU"), (graph, "openvino fp32")} <= engines
    assert {("campplus", "onnxruntime CPU"), ("campplus", "openvino fp32")} <= engines
    measured = [row for row in rows if len(row) == 6 and row[4] not in ("—", "max abs error")]
    full = [float(row[4]) for row in measured if "bf16" not in row[1] and "fp16" not in row[1]]
    assert len(full) == 7 and max(full) < 1e-4  # every fp32 engine agrees with its reference
    # Where this CPU computes in bf16 (AVX512-BF16, AMX), those rows are there too, near their reference.
    half = [float(row[5].rstrip(" |")) for row in measured if "bf16" in row[1] or "fp16" in row[1]]
    assert len(half) == len(measured) - 7 and all(snr > 25 for snr in half), half
    assert {row[0][2:] for row in rows if len(row) == 7} >= {"torch", "onnxruntime", "openvino"}
