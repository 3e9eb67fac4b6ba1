"""ONNX export and the engine runners on the CPU: ONNX Runtime against the torch reference.

Each exported graph runs in ONNX Runtime on inputs of another batch and length than it was traced with
(so the dynamic axes are real), with the streaming flag on and off, on the tiny random folder and on the
golden folder. Then the whole token2wav path (`Token2Wav`, `Token2WavScheduler`) built by `build_token2wav`
with ONNX Runtime against the torch one. TensorRT cannot run here: its fallback, profile shapes and cache
keys are checked.

Tolerances:
- flow encoder, estimator and mel: 1e-4 absolute in fp32, as the flow's golden test.
- `hift_decode` alone, on identical inputs: 1e-5. The only difference is the STFT / iSTFT done as
  convolutions with fixed DFT bases instead of FFTs (measured ~1e-7 on outputs of ~0.1).
- fp16 graphs (matrix products and convolutions in fp16, for TensorRT): 5e-2, about 1% of the range
  of the outputs; ONNX Runtime's fp16 CPU kernels stay within ~4e-3 (see perf/gpu_check.py).
- end-to-end waveforms: 1e-3, as the golden HiFT / end-to-end tests. The mel differences of ~1e-6 move
  the predicted F0 a little, and the harmonic source integrates F0 into phase over the whole chunk, so the
  sines drift apart slowly; 1e-3 is -60 dB of full scale (measured ~5e-5).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from cosyvoice_triton.engines.base import RunnerModule
from cosyvoice_triton.errors import EngineUnavailable
from cosyvoice_triton.engines.onnx_precision import mixed_precision
from cosyvoice_triton.engines.ort_runner import OrtRunner
from cosyvoice_triton.engines.select import (RunnerHiFT, build_token2wav, open_campplus, open_runner,
                                             resolve_engine)
from cosyvoice_triton.engines.torch_runner import TorchRunner
from cosyvoice_triton.engines.trt_build import (build_plan, declared_input_shapes, plan_cache_key,
                                                plan_file, profile_shapes, token2wav_dim_ranges)
from cosyvoice_triton.engines.onnx_export import MANIFEST, token2wav_onnx
from cosyvoice_triton.engines.onnx_graphs import HiFTDecodeGraph, example_inputs, token2wav_specs
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import GeneratorNoise, ZeroNoise
from cosyvoice_triton.token2wav.stream import FlowPrompt, Token2Wav
from cosyvoice_triton.token2wav.scheduler import ChunkRequest, Token2WavScheduler

REPO_ROOT = Path(__file__).resolve().parents[1]
GRAPH_TOL = {"flow_encoder": 1e-4, "flow_estimator": 1e-4, "hift_decode": 1e-5}
MEL_TOL = 1e-4
WAVE_TOL = 1e-3
FP16_TOL = 5e-2


def report(name: str, actual: torch.Tensor | np.ndarray, expected: torch.Tensor | np.ndarray, tol: float) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = float(np.abs(actual - expected).max())
    print(f"{name}: max abs error {err:.2e} (tolerance {tol:.0e})")
    assert err <= tol, f"{name}: max abs error {err:.2e} > {tol:.0e}"


@pytest.fixture(scope="module", params=["tiny", "golden"])
def folder(request, tmp_path_factory) -> tuple[str, Path, dict[str, Path]]:
    """(label, model folder, ONNX graphs exported into a fresh folder)."""
    if request.param == "tiny":
        model_dir = request.getfixturevalue("tiny_model_dir")
    else:
        model_dir = request.getfixturevalue("golden_model_dir")
    return request.param, model_dir, token2wav_onnx(model_dir, tmp_path_factory.mktemp(f"onnx_{request.param}"))


@pytest.fixture(scope="module")
def golden_onnx_dir(golden_model_dir, tmp_path_factory) -> Path:
    onnx_dir = tmp_path_factory.mktemp("onnx_golden_e2e")
    token2wav_onnx(golden_model_dir, onnx_dir)
    return onnx_dir


def test_exported_graphs_are_valid_onnx(folder):
    _, model_dir, paths = folder
    flow_config = FlowModel.from_model_dir(model_dir).config
    assert set(paths) == set(token2wav_specs(flow_config))
    for name, path in paths.items():
        onnx.checker.check_model(str(path), full_check=True)
        graph = onnx.load(str(path), load_external_data=False).graph
        spec = token2wav_specs(flow_config)[name]
        assert [x.name for x in graph.input] == list(spec.inputs) and [x.name for x in graph.output] == [spec.output]
        batch_dims = {x.name: x.type.tensor_type.shape.dim[0].dim_param for x in [*graph.input, *graph.output]}
        assert set(batch_dims.values()) == {"B"}, batch_dims  # every tensor has the dynamic batch axis


@pytest.mark.parametrize("name, streaming", [("flow_encoder", False), ("flow_encoder", True),
                                             ("flow_estimator", False), ("flow_estimator", True),
                                             ("hift_decode", False)])
def test_onnxruntime_matches_torch(folder, name: str, streaming: bool):
    label, model_dir, paths = folder
    flow, hift = FlowModel.from_model_dir(model_dir), HiFTGenerator.from_model_dir(model_dir)
    spec = token2wav_specs(flow.config)[name]
    reference = {"flow_encoder": flow.encoder, "flow_estimator": flow.decoder.estimator, "hift_decode": hift.decode}
    inputs = list(example_inputs(name, flow.config, hift.config, batch=3, frames=110))  # traced with 2 x 46
    if "streaming" in spec.inputs:
        index = spec.inputs.index("streaming")
        inputs[index] = torch.full_like(inputs[index], streaming)
        with torch.inference_mode():  # the flag matters at this length: 110 frames span several chunks
            flipped = inputs[:index] + [~inputs[index]] + inputs[index + 1:]
            assert not torch.allclose(reference[name](*inputs), reference[name](*flipped))
    expected = TorchRunner(reference[name], spec, "cpu")(*inputs)
    actual = OrtRunner(paths[name], spec, "cpu")(*inputs)
    report(f"{label} {name} streaming={streaming}", actual, expected, GRAPH_TOL[name])


def test_hift_decode_twin_equals_decode_in_torch(golden_model_dir, golden):
    """The exported HiFT decode (STFTs as convolutions) in torch itself, as the CUDA-graph benchmark runs it."""
    hift = HiFTGenerator.from_model_dir(golden_model_dir)
    mel = torch.from_numpy(golden["hift_in_mel"])
    with torch.inference_mode():
        source = hift.m_source(hift.f0_predictor(mel), ZeroNoise())
        report("HiFTDecodeGraph vs HiFTGenerator.decode", HiFTDecodeGraph(hift)(mel, source),
               hift.decode(mel, source), GRAPH_TOL["hift_decode"])


def golden_flow_call(flow: FlowModel, golden: dict, n_tokens: int, finalize: bool) -> np.ndarray:
    """The golden flow call on the first `n_tokens` tokens (streaming attention unless finalize)."""
    prompt_token = torch.from_numpy(golden["in_prompt_speech_token"])
    prompt_feat = torch.from_numpy(golden["in_prompt_feat"])
    length = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    mel = flow.inference(torch.from_numpy(golden["flow_token"][:, :n_tokens]), length(n_tokens), prompt_token,
                         length(prompt_token.shape[1]), prompt_feat, length(prompt_feat.shape[1]),
                         torch.from_numpy(golden["in_embedding"]), streaming=not finalize, finalize=finalize)
    return mel.numpy()


def test_flow_mel_with_onnxruntime(golden_model_dir, golden_onnx_dir, golden):
    torch_flow, _ = build_token2wav(golden_model_dir, "torch")
    ort_flow, _ = build_token2wav(golden_model_dir, "onnxruntime", onnx_dir=golden_onnx_dir)
    assert isinstance(ort_flow.decoder.estimator, RunnerModule) and isinstance(ort_flow.encoder, RunnerModule)
    n_all = golden["flow_token"].shape[1]
    report("flow mel offline, onnxruntime vs torch", golden_flow_call(ort_flow, golden, n_all, True),
           golden_flow_call(torch_flow, golden, n_all, True), MEL_TOL)
    report("flow mel offline, onnxruntime vs official", golden_flow_call(ort_flow, golden, n_all, True),
           golden["flow_mel_nonstream"], MEL_TOL)
    for chunk, end in enumerate(golden["flow_stream_chunk_token_ends"]):
        report(f"flow mel streaming chunk {chunk}, onnxruntime vs official",
               golden_flow_call(ort_flow, golden, int(end), False), golden[f"flow_mel_stream_chunk{chunk}"], MEL_TOL)


@pytest.fixture(scope="module")
def token2wav_pair(golden_model_dir, golden_onnx_dir) -> dict[str, Token2Wav]:
    return {engine: Token2Wav(*build_token2wav(golden_model_dir, engine, onnx_dir=golden_onnx_dir))
            for engine in ("torch", "onnxruntime")}


def golden_prompt(golden: dict) -> FlowPrompt:
    return FlowPrompt(speech_tokens=torch.from_numpy(golden["in_prompt_speech_token"]),
                      mel=torch.from_numpy(golden["in_prompt_feat"]),
                      embedding=torch.from_numpy(golden["in_embedding"]))


@pytest.mark.parametrize("streaming", [False, True])
def test_token2wav_audio_with_onnxruntime(token2wav_pair, golden, streaming: bool):
    tokens = golden["flow_token"][0].tolist()
    ends = [int(e) for e in golden["flow_stream_chunk_token_ends"]] if streaming else []
    audio = {}
    for engine, token2wav in token2wav_pair.items():
        stream = token2wav.stream(golden_prompt(golden), ZeroNoise())
        starts = [0, *ends]
        chunks = [stream.chunk(tokens[a:b], finalize=False) for a, b in zip(starts, ends)]
        chunks.append(stream.chunk(tokens[starts[-1]:], finalize=True))
        audio[engine] = chunks
    assert isinstance(token2wav_pair["onnxruntime"].hift, RunnerHiFT)
    for i, (ort_chunk, torch_chunk) in enumerate(zip(audio["onnxruntime"], audio["torch"], strict=True)):
        report(f"token2wav {'streaming' if streaming else 'offline'} chunk {i}, onnxruntime vs torch",
               ort_chunk, torch_chunk, WAVE_TOL)
    if not streaming:
        report("token2wav offline, onnxruntime vs official", audio["onnxruntime"][0], golden["e2e_nonstream"][0],
               WAVE_TOL)


def test_token2wav_engine_batch_with_onnxruntime(token2wav_pair, golden):
    """Two streams batched into one flow call per step, seeded vocoder noise: the same audio on both engines."""
    tokens = golden["flow_token"][0].tolist()
    results = {}
    for engine, token2wav in token2wav_pair.items():
        batcher = Token2WavScheduler(token2wav.flow, token2wav.hift)
        first = [ChunkRequest(sid, tokens[:30 + 5 * k], False, golden_prompt(golden), seed=7 + k)
                 for k, sid in enumerate(["a", "b"])]
        final = [ChunkRequest(sid, tokens[30 + 5 * k:], True, None, None) for k, sid in enumerate(["a", "b"])]
        results[engine] = batcher.run(first) + batcher.run(final)
        assert batcher.stats.max_flow_batch == 2 and batcher.stats.active_streams == 0
    for i, (ort_audio, torch_audio) in enumerate(zip(results["onnxruntime"], results["torch"], strict=True)):
        report(f"Token2WavScheduler chunk {i}, onnxruntime vs torch", ort_audio, torch_audio, WAVE_TOL)


def test_seeded_noise_is_drawn_in_torch_for_every_engine(token2wav_pair, golden):
    """The harmonic source stays in torch: the same seed gives the same source on both engines."""
    mel = torch.from_numpy(golden["hift_in_mel"])
    sources = [token2wav.hift.inference(mel, None, GeneratorNoise.seeded(11))[1]
               for token2wav in token2wav_pair.values()]
    assert torch.equal(sources[0], sources[1])


def test_tensorrt_falls_back_to_onnxruntime_with_one_log_line(tiny_model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton"):
        flow, hift = build_token2wav(tiny_model_dir, "tensorrt", "cpu", onnx_dir=tmp_path)
    fallbacks = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(fallbacks) == 1, [r.getMessage() for r in fallbacks]
    assert "'tensorrt'" in fallbacks[0].getMessage() and "'onnxruntime'" in fallbacks[0].getMessage()
    assert flow.decoder.estimator.runner.engine == "onnxruntime" and hift.decode_runner.engine == "onnxruntime"


def test_engine_names(caplog):
    with pytest.raises(ValueError, match="unknown engine 'tensorflow'"):
        resolve_engine("tensorflow", "cpu")
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton"):
        assert resolve_engine("torch", "cpu") == "torch"
        assert resolve_engine("onnxruntime", "cpu") == "onnxruntime"
    assert not caplog.records
    with pytest.raises(ValueError, match="unknown engine"):
        build_token2wav("/nonexistent", "tensorflow")


def test_onnx_is_exported_again_only_when_the_checkpoints_change(tiny_model_dir, tmp_path, caplog):
    first = token2wav_onnx(tiny_model_dir, tmp_path)
    stamps = {name: path.stat().st_mtime_ns for name, path in first.items()}
    with caplog.at_level(logging.INFO, logger="cosyvoice_triton"):
        assert token2wav_onnx(tiny_model_dir, tmp_path) == first
    assert not [r for r in caplog.records if "exporting" in r.getMessage()]
    assert {name: path.stat().st_mtime_ns for name, path in first.items()} == stamps
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["sources"]["flow.pt"] = "0" * 64  # as if flow.pt had changed since the export
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.INFO, logger="cosyvoice_triton"):
        token2wav_onnx(tiny_model_dir, tmp_path)
    assert [r for r in caplog.records if "exporting" in r.getMessage()]


def test_campplus_runner(golden_model_dir, golden, caplog):
    runner = open_campplus(golden_model_dir, "onnxruntime", "cpu")
    embedding = runner(torch.from_numpy(golden["onnx_campplus_in"]))
    report("campplus onnxruntime vs golden", embedding, golden["onnx_campplus_out"], 1e-4)
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton"):
        assert open_campplus(golden_model_dir, "tensorrt", "cpu").engine == "onnxruntime"
    assert len(caplog.records) == 1


@pytest.mark.parametrize("name", ["flow_encoder", "flow_estimator", "hift_decode"])
def test_fp16_graph_for_tensorrt_runs_close_to_torch(folder, name: str, tmp_path):
    """The strongly typed fp16 copy that TensorRT builds from, run here by ONNX Runtime's fp16 CPU kernels."""
    label, model_dir, paths = folder
    flow, hift = FlowModel.from_model_dir(model_dir), HiFTGenerator.from_model_dir(model_dir)
    spec = token2wav_specs(flow.config)[name]
    original = onnx.load(str(paths[name]))
    model = mixed_precision(original, "fp16")
    onnx.checker.check_model(model, full_check=True)
    io_types = lambda m: {x.name: x.type.tensor_type.elem_type for x in [*m.graph.input, *m.graph.output]}  # noqa: E731
    assert io_types(model) == io_types(original)  # the engine's inputs and outputs stay fp32
    onnx.save(model, str(tmp_path / f"{name}.fp16.onnx"))
    inputs = example_inputs(name, flow.config, hift.config, batch=3, frames=110)
    reference = {"flow_encoder": flow.encoder, "flow_estimator": flow.decoder.estimator, "hift_decode": hift.decode}
    with torch.inference_mode():
        expected = reference[name](*inputs)
    actual = OrtRunner(tmp_path / f"{name}.fp16.onnx", spec, "cpu")(*inputs)
    assert actual.dtype == torch.float32 and torch.isfinite(actual).all()
    report(f"{label} {name} fp16 graph", actual, expected, FP16_TOL)


def test_bf16_graph_keeps_convolutions_fp32_before_opset_22(folder):
    _, _, paths = folder
    model = mixed_precision(onnx.load(str(paths["flow_estimator"])), "bf16")
    onnx.checker.check_model(model, full_check=True)
    inputs = {op: [name for node in model.graph.node if node.op_type == op for name in node.input]
              for op in ("MatMul", "Conv")}
    assert inputs["MatMul"] and all(name.endswith(".bf16") for name in inputs["MatMul"])
    assert inputs["Conv"] and not any(name.endswith(".bf16") for name in inputs["Conv"])


# ---- TensorRT parts that need no GPU ----

def test_tensorrt_profiles_cover_guided_batches_and_60_seconds(folder):
    _, model_dir, paths = folder
    config = FlowModel.from_model_dir(model_dir).config
    ranges = token2wav_dim_ranges(config, max_streams=16, max_seconds=60)
    specs = token2wav_specs(config)
    declared = declared_input_shapes(paths["flow_estimator"])
    assert declared["x"] == (-1, 80, -1) and declared["spks"] == (-1, 80)
    shapes = profile_shapes(specs["flow_estimator"], declared, ranges["flow_estimator"])
    assert shapes["x"] == ((2, 80, 1), (8, 80, 400), (32, 80, 3000))  # 2N rows for N <= 16 streams
    assert shapes["t"] == ((2,), (8,), (32,)) and shapes["spks"][2] == (32, 80)
    encoder = profile_shapes(specs["flow_encoder"], {"x": (-1, -1, 512), "lengths": (-1,)}, ranges["flow_encoder"])
    assert encoder["x"][2] == (16, 1500 + config.pre_lookahead_len, 512) and encoder["lengths"][2] == (16,)
    hift = profile_shapes(specs["hift_decode"], {"mel": (-1, 80, -1), "source": (-1, 1, -1)}, ranges["hift_decode"])
    assert hift["source"][2] == (16, 1, 3000 * 480)
    with pytest.raises(ValueError, match="dynamic in the graph but not in the spec"):
        profile_shapes(specs["flow_estimator"], {"spks": (-1, -1)}, ranges["flow_estimator"])


def test_tensorrt_cache_key_changes_with_everything_an_engine_depends_on():
    profile = {"x": ((1, 80, 1), (8, 80, 400), (32, 80, 3000))}
    base = dict(onnx_sha256="a" * 64, gpu_name="NVIDIA H200", trt_version="10.13.0", precision="fp16",
                profiles=profile)
    key = plan_cache_key(**base)
    assert key == plan_cache_key(**base)
    changes = [{"onnx_sha256": "b" * 64}, {"gpu_name": "NVIDIA H100 80GB HBM3"}, {"trt_version": "10.14.1"},
               {"precision": "fp32"}, {"profiles": {"x": ((1, 80, 1), (8, 80, 400), (16, 80, 3000))}}]
    assert len({key, *(plan_cache_key(**{**base, **change}) for change in changes)}) == 1 + len(changes)
    assert plan_file("/cache", "/m/onnx/flow_estimator.onnx", "fp16", key) == \
        Path(f"/cache/flow_estimator.fp16.{key[:16]}.plan")


def test_tensorrt_is_a_clear_error_without_tensorrt_or_cuda(folder):
    _, model_dir, paths = folder
    spec = token2wav_specs(FlowModel.from_model_dir(model_dir).config)["flow_estimator"]
    with pytest.raises(EngineUnavailable, match="tensorrt|CUDA"):
        build_plan(paths["flow_estimator"], spec, {"B": (2, 8, 32), "T": (1, 400, 3000)}, device="cpu")
    with pytest.raises(EngineUnavailable, match="tensorrt|CUDA"):
        open_runner(paths["flow_estimator"], spec, "tensorrt", "cpu", ranges={"B": (2, 8, 32), "T": (1, 4, 9)})


# ---- perf/gpu_check on the CPU: every part up to the GPU-only columns ----

def test_gpu_check_runs_on_the_cpu(tmp_path, capsys):
    from cosyvoice_triton.perf import gpu_check

    out = tmp_path / "report.md"
    assert gpu_check.main(["--device", "cpu", "--family", "cosyvoice2", "--size", "tiny", "--work-dir", str(tmp_path),
                           "--batches", "1", "--chunks", "0.2", "--iters", "1", "--parity-case", "1,0.2", "--out", str(out)]) == 0
    report_text = out.read_text()
    assert report_text == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "| TRT fp16 | unavailable: " in report_text and "| torch CUDA graphs | unavailable: " in report_text
    parity = [line for line in report_text.splitlines() if "| ORT CPU |" in line and line.count("|") == 6]
    assert len(parity) == 5 and all(line.endswith("| yes |") for line in parity), parity
    timings = [line for line in report_text.splitlines() if "| 0.2 s |" in line]
    assert [line.split(" | ")[0] for line in timings] == ["| estimator step", "| estimator 10-step loop", "| HiFT",
                                                         "| CAM++"]


def test_gpu_check_script_dry_run(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "COSYVOICE_PERF_RESULTS": str(tmp_path / "out")}
    result = subprocess.run(["bash", str(REPO_ROOT / "perf" / "gpu_check.sh"), "--dry-run", "--family", "cosyvoice2",
                             "--size", "tiny", "--work-dir", str(tmp_path / "work")], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    (report,) = (tmp_path / "out").glob("gpu-check-*.md")  # the default report file under the results folder
    assert "dry run: stopped before loading any engine" in report.read_text()
    assert sorted(p.name for p in (tmp_path / "work" / "onnx_cosyvoice2-tiny").glob("*.onnx")) == [
        "flow_encoder.onnx", "flow_estimator.onnx", "hift_decode.onnx"]
