"""The flow estimator statically quantized to int8 by ONNX Runtime, and one estimator call per precision, timed.

    python -m cosyvoice_triton.perf.flow_int8_static --model-dir DIR [--out DIR] [--frames 300] [--rounds 5] \
        [--threads 2]

Post-training static quantization (`onnxruntime.quantization.quantize_static`) of the estimator's ONNX graph
(engines/onnx_export.py): QDQ, int8 weights per output channel, uint8 activations with ranges from MinMax
calibration, every MatMul, Gemm and Conv. The calibration inputs are the project's own: the estimator's inputs
at every Euler step of fp32 flow calls (offline, and the official chunk schedule's streamed calls) on a
speech-like prompt and random tokens of seeds the quality judge does not use (`CALIBRATION_SEEDS`).
`static_int8_estimator(model_dir)` writes `flow_estimator_int8_static.onnx` beside the fp32 graphs once and
returns its path; perf/flow_quality.py's `int8-static` variant judges it.

Then one estimator call (the guidance batch: 2 rows of `--frames` frames, full attention) per arithmetic, in
interleaved rounds, medians: torch fp32, bf16 (autocast), int8-dynamic, and ONNX Runtime fp32 and int8-static
on `--threads` threads; with the load average at the start and end. The graph re-runs every frame of a stream
at every chunk (ONNX graphs take no flow cache, models/flow_cache.py), so a per-call speed-up has to beat the
cache's saving before it pays in a served stream.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

CALIBRATION_SEEDS = (100, 101, 102)
CALIBRATION_TOKENS = 100
STATIC_GRAPH = "flow_estimator_int8_static.onnx"


def calibration_inputs(model_dir: str | Path, seeds=CALIBRATION_SEEDS, speech_tokens: int = CALIBRATION_TOKENS,
                       prompt_tokens: int = 50) -> list[dict[str, np.ndarray]]:
    """The fp32 estimator's inputs (name -> array) at every Euler step of an offline flow call and of each
    streamed call of the official chunk schedule, per seed."""
    from cosyvoice_triton.engines.onnx_graphs import flow_estimator_spec
    from cosyvoice_triton.models.flow_cache import FlowCacheSettings
    from cosyvoice_triton.perf.flow_cache_bench import TimedToken2Wav
    from cosyvoice_triton.perf.flow_paths import load_judged, offline, streamed

    flow, hift, prompt = load_judged(model_dir, prompt_tokens)
    names = flow_estimator_spec().inputs
    captured: list[dict[str, np.ndarray]] = []

    def keep(_module, args):
        captured.append({name: x.detach().numpy().copy() for name, x in zip(names, args)})

    flow.decoder.estimator.register_forward_pre_hook(keep)
    token2wav = TimedToken2Wav(flow, hift, FlowCacheSettings(enabled=False))  # every call through the estimator
    for seed in seeds:
        tokens = torch.randint(0, flow.config.vocab_size, (speech_tokens,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        offline(token2wav, prompt, tokens, seed)
        streamed(token2wav, prompt, tokens, seed)
    return captured


def static_int8_estimator(model_dir: str | Path, out: str | Path | None = None) -> Path:
    """`out` (default `<model_dir>/onnx`, where the fp32 graphs go)/flow_estimator_int8_static.onnx, quantized
    from the model folder's estimator graph the first time (see the module docstring)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from cosyvoice_triton.engines.onnx_export import token2wav_onnx

    out = Path(out) if out is not None else Path(model_dir) / "onnx"
    path = out / STATIC_GRAPH
    if path.exists():
        return path
    fp32 = token2wav_onnx(model_dir, out)["flow_estimator"]
    prepared = out / "flow_estimator_prepared.onnx"  # shapes inferred and graph optimized, as the tool advises
    quant_pre_process(fp32, prepared)

    class Reader(CalibrationDataReader):
        def __init__(self, feeds):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(prepared, path, Reader(calibration_inputs(model_dir)), quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=["MatMul", "Gemm", "Conv"], per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return path


def ort_estimator(path: str | Path, threads: int):
    """The estimator graph at `path` as a torch module (engines' RunnerModule over an ONNX Runtime session)."""
    from cosyvoice_triton.engines.base import RunnerModule
    from cosyvoice_triton.engines.onnx_graphs import flow_estimator_spec
    from cosyvoice_triton.engines.ort_runner import OrtRunner

    return RunnerModule(OrtRunner(path, flow_estimator_spec(), "cpu", intra_op_threads=threads))


def timed_calls(model_dir: str, out: str | None, frames: int, rounds: int, threads: int) -> dict[str, list[float]]:
    """Seconds of one estimator call per arithmetic, `rounds` interleaved rounds after one warm-up call each."""
    from cosyvoice_triton.engines.onnx_export import token2wav_onnx
    from cosyvoice_triton.models.flow import FlowModel

    flow = FlowModel.from_model_dir(model_dir)
    dynamic = copy.deepcopy(flow.decoder)
    dynamic.set_precision("int8-dynamic")
    g = torch.Generator().manual_seed(0)
    rows, mels = 2, flow.config.mel_bins
    x, mu, cond = (torch.randn(rows, mels, frames, generator=g) for _ in range(3))
    inputs = (x, torch.ones(rows, 1, frames), mu, torch.full((rows,), 0.5), torch.randn(rows, mels, generator=g),
              cond, torch.zeros(rows, dtype=torch.bool))

    def torch_call(estimator, arithmetic=None):
        def call():
            with torch.inference_mode(), arithmetic or torch.autocast("cpu", enabled=False):
                return estimator(*inputs).float()
        return call

    calls = {"torch fp32": torch_call(flow.decoder.estimator),
             "torch bf16": torch_call(flow.decoder.estimator, torch.autocast("cpu", dtype=torch.bfloat16)),
             "torch int8-dynamic": torch_call(dynamic.estimator),
             "onnxruntime fp32": torch_call(ort_estimator(token2wav_onnx(model_dir, out)["flow_estimator"], threads)),
             "onnxruntime int8-static": torch_call(ort_estimator(static_int8_estimator(model_dir, out), threads))}
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", help="where the ONNX graphs are written and kept (default: <model-dir>/onnx)")
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    static_int8_estimator(args.model_dir, args.out)
    load = os.getloadavg()[0]
    seconds = timed_calls(args.model_dir, args.out, args.frames, args.rounds, args.threads)
    reference = statistics.median(seconds["torch fp32"])
    print(f"one estimator call, 2 rows x {args.frames} frames, {args.threads} threads, {args.rounds} interleaved "
          f"rounds; CPU capability {torch.backends.cpu.get_cpu_capability()}\n")
    print("| arithmetic | median ms | best ms | speed-up vs torch fp32 (medians) |\n|---|---:|---:|---:|")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} | {1000 * median:.1f} | {1000 * min(values):.1f} | {reference / median:.2f}x |")
    print(f"\nload average {load:.1f} -> {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
