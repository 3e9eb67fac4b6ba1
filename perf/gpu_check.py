"""GPU check of the token2wav and CAM++ engines: parity with torch, then per-call times, as markdown.

    bash perf/gpu_check.sh                      # on a machine with an NVIDIA GPU (its header says what it needs)
    python -m cosyvoice_triton.perf.gpu_check --dry-run                         # folder + ONNX export only
    python -m cosyvoice_triton.perf.gpu_check --device cpu --size tiny --batches 1 --chunks 1 --iters 2

Each model family (`--family`, default both) gets a report of its own, in this order. Steps: a random model
folder of the family (`--size full`, no backbone weights) -> ONNX export -> each engine column
(torch eager, torch with CUDA graphs, ONNX Runtime CUDA, TensorRT fp16 and fp32; engines are built once
and cached in the work folder) -> parity of each engine with torch -> the median time of one call of the
estimator (one Euler step on 2N rows), the whole 10-step loop, HiFT and CAM++ for N = 1, 4, 16 streams
and 1 s / 4 s chunks. An engine that cannot run says why in its column and the check goes on. CosyVoice3's
token2wav (the DiT estimator, the causal HiFT) has no ONNX graphs: only the torch columns run for it, and
its HiFT has no CUDA-graph twin (n/a). The report
goes to stdout and to `--out`, default $COSYVOICE_PERF_RESULTS/gpu-check-<time>.md (perf/results/ of the
checkout when that is unset). TF32 is off everywhere: fp32 means fp32.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import Tensor

from cosyvoice_triton.engines.onnx_export import token2wav_onnx
from cosyvoice_triton.engines.onnx_graphs import HiFTDecodeGraph, example_inputs
from cosyvoice_triton.engines.select import build_token2wav, open_campplus, unavailable_reason
from cosyvoice_triton.engines.torch_runner import CudaGraphCall
from cosyvoice_triton.family import FAMILIES, family_named, family_of
from cosyvoice_triton.models.causal_hift import CausalHiFTGenerator
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.perf.report import results_dir
from cosyvoice_triton.random_folder.write import write_random_model

MODULES = ("estimator step", "estimator 10-step loop", "HiFT", "CAM++")
MEL_RATE, FBANK_RATE = 50, 100  # frames per second
# max abs error allowed against the reference, by precision: flow outputs (encoder, velocity, mel), the
# waveform, and CAM++'s embedding after L2 normalisation (the flow uses only its direction)
TOLERANCES = {"fp32": {"flow": 1e-3, "wave": 1e-3, "campplus": 1e-4},
              "fp16": {"flow": 5e-2, "wave": 5e-2, "campplus": 1e-2},
              "bf16": {"flow": 2e-1, "wave": 1e-1, "campplus": 4e-2}}
TOLERANCE_NOTE = (
    "Tolerances. fp32 engines: 1e-3 absolute on outputs of magnitude 1-5, since GPU kernels add in other "
    "orders than torch's and pick other convolution algorithms (on the CPU, ONNX Runtime fp32 is within "
    "~5e-6). fp16 engines compute matrix products and convolutions in fp16 (the rest in fp32, see "
    "engines/onnx_precision.py): each of the ~100 of them in sequence rounds its inputs at 2^-11 = 4.9e-4 "
    "relative, and the errors add up to ~1e-2 on values of 1-5 (ONNX Runtime's fp16 kernels on the CPU: "
    "2-4e-3 on one estimator step and on the 10-step mel of the full-size model). 5e-2 absolute, about 1% "
    "of the mel range, leaves room for kernels that also accumulate in fp16; on the waveform (+-0.99) it is "
    "-26 dB of full scale. CAM++: its embedding after L2 normalisation (components ~0.07), 1e-2 in fp16. "
    "bf16 keeps 8 mantissa bits (3.9e-3 relative): bounds 4x looser. Every output must also be finite.")


@dataclass(frozen=True)
class Column:
    label: str
    engine: str  # torch | onnxruntime | tensorrt
    precision: str = "fp32"
    cuda_graphs: bool = False


@dataclass
class Stack:
    """One column's modules: flow and HiFT as served, CAM++ (None for torch: it ships as ONNX only)."""

    flow: FlowModel
    hift: HiFTGenerator
    campplus: Callable[[Tensor], Tensor] | None
    load_seconds: float


def columns(precisions: list[str], device: torch.device) -> list[Column]:
    """The torch reference first."""
    return [Column("torch eager", "torch"), Column("torch CUDA graphs", "torch", cuda_graphs=True),
            Column(f"ORT {device.type.upper()}", "onnxruntime"),
            *(Column(f"TRT {p}", "tensorrt", precision=p) for p in precisions)]


def open_stack(column: Column, model_dir: Path, onnx_dir: Path, device: torch.device, max_streams: int,
               max_seconds: float) -> Stack | str:
    """The column's modules, or why it cannot run here. TensorRT profiles: up to `max_streams` streams
    (2 * max_streams estimator rows) and `max_seconds` of mel."""
    reason = unavailable_reason(column.engine, device)
    if column.cuda_graphs and device.type != "cuda":
        reason = "CUDA graphs need a CUDA device"
    models = family_models(model_dir)
    if column.engine != "torch" and not models.graphs:
        reason = f"{models.family}'s token2wav has no ONNX graphs (it runs on torch)"
    if reason is not None:
        return reason
    start = time.perf_counter()
    try:
        flow, hift = build_token2wav(model_dir, column.engine, device, precision=column.precision, onnx_dir=onnx_dir,
                                     max_streams=max_streams, max_seconds=max_seconds)
        campplus = None if column.engine == "torch" else open_campplus(
            model_dir, column.engine, device, precision=column.precision, cache_dir=onnx_dir / "trt",
            max_batch=max_streams)
    except Exception as error:  # noqa: BLE001 - one engine failing must not stop the check of the others
        return f"{type(error).__name__}: {error}"
    return Stack(flow, hift, campplus, time.perf_counter() - start)


def case_inputs(module: str, streams: int, seconds: float, flow: FlowModel, hift: HiFTGenerator,
                device: torch.device) -> tuple[Tensor, ...]:
    frames = round(seconds * MEL_RATE)
    g = torch.Generator().manual_seed(1)
    if module == "estimator step":  # a guided batch: 2 rows per stream
        inputs = example_inputs("flow_estimator", flow.config, hift.config, batch=2 * streams, frames=frames)
    elif module == "estimator 10-step loop":  # FlowMatching(mu, mask, spks, cond, streaming)
        bins = flow.config.mel_bins
        inputs = (torch.randn(streams, bins, frames, generator=g), torch.ones(streams, 1, frames),
                  torch.randn(streams, bins, generator=g), torch.zeros(streams, bins, frames),
                  torch.ones(streams, dtype=torch.bool))
    elif module == "HiFT":
        inputs = (torch.randn(streams, flow.config.mel_bins, frames, generator=g) - 5,)
    else:  # CAM++: 80-bin fbank at 100 frames per second
        inputs = (torch.randn(streams, round(seconds * FBANK_RATE), 80, generator=g),)
    return tuple(x.to(device) for x in inputs)


def module_call(stack: Stack, module: str, cuda_graphs: bool) -> Callable[..., Tensor] | None:
    """What one call of `module` runs in this column (None: not on this engine)."""
    if module == "estimator step":
        return stack.flow.decoder.estimator
    if module == "estimator 10-step loop":
        return stack.flow.decoder
    if module == "HiFT" and cuda_graphs:
        if isinstance(stack.hift, CausalHiFTGenerator):  # no exported twin of its decode
            return None
        # torch.istft checks its window envelope on the host, which a capture forbids: capture the
        # exported twin of `decode` (STFTs as convolutions) instead.
        decode = HiFTDecodeGraph(stack.hift)
        return lambda mel: decode(mel, stack.hift.m_source(stack.hift.f0_predictor(mel), ZeroNoise()))
    if module == "HiFT":
        return lambda mel: vocode(stack.hift, mel)
    return None if cuda_graphs else stack.campplus


def vocode(hift, mel: Tensor) -> Tensor:
    """The vocoder's audio of a whole mel, zero noise: CosyVoice3's causal HiFT takes `finalize` where
    CosyVoice2's takes the cached source of a previous chunk."""
    if isinstance(hift, CausalHiFTGenerator):
        return hift.inference(mel, finalize=True, noise=ZeroNoise())[0]
    return hift.inference(mel, None, ZeroNoise())[0]


def median_ms(fn: Callable[..., Tensor], inputs: tuple[Tensor, ...], device: torch.device, iters: int) -> float:
    with torch.inference_mode():
        for _ in range(2):  # warm-up: lazy initialisation, cuDNN / ORT algorithm search
            fn(*inputs)
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*inputs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(*inputs)
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def parity_rows(reference: Stack, stacks: dict[Column, Stack], model_dir: Path, device: torch.device,
                streams: int, seconds: float) -> list[str]:
    """Max abs error of every non-torch column against torch eager (CAM++: against ONNX Runtime CPU)."""
    flow, hift = reference.flow, reference.hift
    encoder_in = tuple(x.to(device) for x in example_inputs("flow_encoder", flow.config, hift.config, streams,
                                                             round(seconds * MEL_RATE)))
    step_in = case_inputs("estimator step", streams, seconds, flow, hift, device)
    loop_in = case_inputs("estimator 10-step loop", streams, seconds, flow, hift, device)
    fbank = case_inputs("CAM++", streams, seconds, flow, hift, device)[0]
    with torch.inference_mode():
        mel = flow.decoder(*loop_in)
        expected = {"flow encoder": flow.encoder(*encoder_in), "estimator step": flow.decoder.estimator(*step_in),
                    "mel (10 steps)": mel, "HiFT waveform": vocode(hift, mel)}
    expected["CAM++"] = F.normalize(open_campplus(model_dir, "onnxruntime", "cpu")(fbank.cpu()), dim=1)
    rows = []
    for column, stack in stacks.items():
        if column.engine == "torch":
            continue
        try:
            with torch.inference_mode():
                actual = {"flow encoder": stack.flow.encoder(*encoder_in),
                          "estimator step": stack.flow.decoder.estimator(*step_in),
                          "mel (10 steps)": stack.flow.decoder(*loop_in),
                          "HiFT waveform": vocode(stack.hift, mel),
                          "CAM++": F.normalize(stack.campplus(fbank).float(), dim=1)}
        except Exception as error:  # noqa: BLE001 - reported in its row; the other engines are still checked
            rows.append(f"| all | {column.label} | {type(error).__name__}: {error} | | **NO** |")
            continue
        tolerances = TOLERANCES[column.precision]
        for output, value in actual.items():
            value = value.float().cpu()
            err = float((value - expected[output].float().cpu()).abs().max())
            tol = tolerances["wave" if output == "HiFT waveform" else "campplus" if output == "CAM++" else "flow"]
            ok = bool(torch.isfinite(value).all()) and err <= tol
            rows.append(f"| {output} | {column.label} | {err:.2e} | {tol:.0e} | {'yes' if ok else '**NO**'} |")
    return rows


def timing_rows(reference: Stack, stacks: dict[Column, Stack | str], batches: list[int], chunks: list[float],
                device: torch.device, iters: int) -> list[str]:
    rows = []
    for module in MODULES:
        for streams in batches:
            for seconds in chunks:
                inputs = case_inputs(module, streams, seconds, reference.flow, reference.hift, device)
                cells = []
                for column, stack in stacks.items():
                    fn = None if isinstance(stack, str) else module_call(stack, module, column.cuda_graphs)
                    if fn is None:
                        cells.append("n/a")
                        continue
                    try:
                        if column.cuda_graphs:
                            fn = CudaGraphCall(fn, inputs)
                        cells.append(f"{median_ms(fn, inputs, device, iters):.2f}")
                    except Exception as error:  # noqa: BLE001 - one failing cell must not end the check
                        cells.append(f"{type(error).__name__}: {str(error)[:80]}")
                rows_label = f"{2 * streams} rows" if module == "estimator step" else f"{streams}"
                rows.append(f"| {module} | {rows_label} | {seconds:g} s | " + " | ".join(cells) + " |")
    return rows


def versions(device: torch.device) -> str:
    try:
        import tensorrt
        trt = f"TensorRT {tensorrt.__version__}"
    except ImportError:
        trt = "TensorRT absent"
    gpu = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "none visible to torch"
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    return (f"GPU: {gpu}; torch {torch.__version__}{cuda}; onnxruntime {ort.__version__} "
            f"({', '.join(ort.get_available_providers())}); {trt}; numpy {np.__version__}")


def prepare(args: argparse.Namespace, family: str) -> tuple[Path, Path, list[str]]:
    """Model folder and ONNX graphs -> (model_dir, onnx_dir, report lines)."""
    lines = []
    model_dir = args.model_dir or args.work_dir / f"{family}-{args.size}"
    if args.model_dir is None and not (model_dir / family_named(family).speech_tokenizer_file).exists():
        start = time.perf_counter()  # the tokenizer is the last file write_random_model writes
        write_random_model(model_dir, size=args.size, backbone_weights=False, family=family)
        lines.append(f"- wrote the {args.size} random folder {model_dir} in {time.perf_counter() - start:.1f} s")
    onnx_dir = args.work_dir / f"onnx_{model_dir.name}"
    if not family_models(model_dir).graphs:
        lines.append(f"- no ONNX export: {family}'s token2wav has no graphs")
        return model_dir, onnx_dir, lines
    start = time.perf_counter()
    paths = token2wav_onnx(model_dir, onnx_dir)
    sizes = ", ".join(f"{name} {path.stat().st_size / 2**20:.0f} MiB" for name, path in paths.items())
    lines.append(f"- ONNX graphs in {onnx_dir} ({sizes}), ready in {time.perf_counter() - start:.1f} s")
    return model_dir, onnx_dir, lines


def run(args: argparse.Namespace, family: str) -> str:
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lines = [f"# token2wav engines: GPU check ({family})", "",
             f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {versions(device)}",
             "- TF32 off in torch and TensorRT: fp32 means fp32"]
    model_dir, onnx_dir, prepared = prepare(args, family)
    lines += prepared
    if args.dry_run:
        return "\n".join(lines + ["", "dry run: stopped before loading any engine"]) + "\n"

    all_columns = columns(args.precisions, device)
    stacks: dict[Column, Stack | str] = {
        c: open_stack(c, model_dir, onnx_dir, device, max(args.batches), args.max_seconds) for c in all_columns}
    reference = stacks[all_columns[0]]
    if isinstance(reference, str):
        raise RuntimeError(f"the torch reference cannot run: {reference}")
    lines += ["", "## Engines", "", "| column | status | load / build s |", "|---|---|---|"]
    for column, stack in stacks.items():
        status = f"unavailable: {stack}" if isinstance(stack, str) else "ok"
        seconds = "" if isinstance(stack, str) else f"{stack.load_seconds:.1f}"
        lines.append(f"| {column.label} | {status} | {seconds} |")
    ready = {c: s for c, s in stacks.items() if not isinstance(s, str)}
    streams, seconds = args.parity_case
    lines += ["", f"## Parity with torch (max abs error; {streams} streams, {seconds:g} s)", ""]
    if any(column.engine != "torch" for column in ready):
        lines += [TOLERANCE_NOTE, "", "| output | engine | max abs error | tolerance | ok |", "|---|---|---|---|---|"]
        lines += parity_rows(reference, ready, model_dir, device, streams, seconds)
    else:
        lines.append("No engine besides torch runs here: nothing to compare.")
    lines += ["", f"## Time per call (ms, median of {args.iters})", "",
              "estimator step: one Euler step on the guided batch (2 rows per stream); 10-step loop: "
              "FlowMatching on N streams; HiFT: F0 + source (torch) + decode; CAM++: fbank -> embedding. "
              "torch CUDA graphs: HiFT's decode with the STFTs as convolutions (torch.istft cannot be captured).",
              "", "| module | streams | chunk | " + " | ".join(c.label for c in all_columns) + " |",
              "|---|---|---|" + "---|" * len(all_columns)]
    lines += timing_rows(reference, stacks, args.batches, args.chunks, device, args.iters)
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.perf.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda[:N], or cpu for a smoke run of the same code")
    p.add_argument("--family", choices=[f.name for f in FAMILIES], nargs="+", default=[f.name for f in FAMILIES],
                   help="model families, each on a random folder of its own (default: all)")
    p.add_argument("--size", choices=["tiny", "full"], default="full")
    p.add_argument("--model-dir", type=Path, help="an existing model folder instead of random ones (its family "
                                                  "alone runs)")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "cosyvoice_gpu_check")
    p.add_argument("--dry-run", action="store_true", help="stop after the model folder and the ONNX export")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16],
                   help="streams per call (comma-separated)")
    p.add_argument("--chunks", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 4.0],
                   help="chunk lengths in seconds (comma-separated)")
    p.add_argument("--parity-case", type=lambda s: (int(s.split(",")[0]), float(s.split(",")[1])), default=(4, 4.0),
                   help="streams,seconds of the parity inputs")
    p.add_argument("--precisions", type=lambda s: s.split(","), default=["fp16", "fp32"],
                   help="TensorRT builds (fp16, fp32, bf16)")
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="mel length (prompt included) the TensorRT profiles cover; the largest of --batches "
                        "sets their streams")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, help="also write the report here (default $COSYVOICE_PERF_RESULTS/"
                                            "gpu-check-<time>.md, $COSYVOICE_PERF_RESULTS defaulting to perf/results)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    families = [family_of(args.model_dir).name] if args.model_dir is not None else args.family
    report = "\n".join(run(args, family) for family in families)
    print(report)
    out = args.out or results_dir() / time.strftime("gpu-check-%Y%m%d-%H%M%S.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
