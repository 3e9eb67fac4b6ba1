"""Engine choice: which engine runs token2wav and CAM++, and the fallback when it cannot run here.

    flow, hift = build_token2wav(model_dir, engine="tensorrt", device="cuda:0", precision="fp16")
    Token2WavScheduler(flow, hift, ...)  # or Token2Wav(flow, hift): same interface as the torch modules

`engine` is one of ENGINES: "torch" (the reference), "onnxruntime" (CPU, CUDA with IOBinding, or the
execution providers of `ort_providers`, engines/providers.py), "openvino" (the OpenVINO runtime on the
CPU) or "tensorrt" (CUDA only). An engine that cannot run here (package, execution provider or GPU
missing) falls back to the next more portable one, tensorrt -> onnxruntime -> torch and openvino ->
onnxruntime, with one warning line that says why; an unknown name is a ValueError. Errors past that
choice (a graph that does not build, shapes outside a TensorRT profile) are raised, never hidden by a
fallback.

With a graph engine (onnxruntime, openvino, tensorrt) the returned FlowModel runs its encoder and the
estimator of each Euler step on that engine (`RunnerModule` in their place) and keeps the rest in
torch: embeddings, masks, the fixed noise, the 10-step loop and the guidance mix. The returned HiFT is a `RunnerHiFT`: F0
predictor and harmonic source in torch (the source draws each request's noise), `decode` on the engine.
The ONNX graphs come from `engines.onnx_export.token2wav_onnx` (exported on first use into
`<model_dir>/onnx` unless `onnx_dir` is given); TensorRT plans are cached under `<onnx_dir>/trt`.
The graphs are CosyVoice2's: a CosyVoice3 folder (DiT flow, causal HiFT) runs token2wav on torch whatever
the engine asked (one warning line), CAM++ on the engine asked.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import onnxruntime as ort
import torch
from torch import Tensor

from ..config import ModelPaths
from ..models.auto_precision import resolve_flow_precision
from ..models.family import Vocoder, family_models
from ..models.flow import TokenToMel
from ..models.hift import HiFTGenerator
from .base import ENGINES, PRECISIONS, GraphSpec, Runner, RunnerModule
from .onnx_session import CUDA_PROVIDER
from .trt_build import DimRanges, build_plan, campplus_dim_ranges, token2wav_dim_ranges

log = logging.getLogger(__name__)

_FALLBACK = {"tensorrt": "onnxruntime", "openvino": "onnxruntime", "onnxruntime": "torch"}


def unavailable_reason(engine: str, device: str | torch.device) -> str | None:
    """Why `engine` cannot run on `device` here, or None if it can."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        return f"device {device} requested but torch sees no CUDA device"
    if engine == "onnxruntime" and cuda and CUDA_PROVIDER not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no {CUDA_PROVIDER} (install onnxruntime-gpu)"
    if engine == "openvino":
        from .openvino_runner import openvino_unavailable_reason

        return openvino_unavailable_reason()
    if engine == "tensorrt":
        if importlib.util.find_spec("tensorrt") is None:
            return "the tensorrt Python package is not installed"
        if not cuda:
            return f"TensorRT runs on CUDA devices only, not {device}"
    return None


def resolve_engine(engine: str, device: str | torch.device) -> str:
    """`engine` if it can run on `device`, else the first fallback that can (logged once)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    chosen, reasons = engine, []
    while (reason := unavailable_reason(chosen, device)) is not None:
        if chosen not in _FALLBACK:
            raise RuntimeError(f"engine {chosen!r} cannot run on {device}: {reason}")
        reasons.append(f"{chosen}: {reason}")
        chosen = _FALLBACK[chosen]
    if chosen != engine:
        log.warning("engine %r is not available on %s (%s); using %r", engine, device, "; ".join(reasons), chosen)
    return chosen


def open_runner(onnx_path: str | Path, spec: GraphSpec, engine: str, device: str | torch.device, *,
                ranges: DimRanges | None = None, precision: str = "fp32", cache_dir: str | Path | None = None,
                ort_providers: str | None = None) -> Runner:
    """A runner for one ONNX graph on an engine already resolved ("onnxruntime", "openvino" or "tensorrt").
    TensorRT needs the profile `ranges`; the engine is built, or taken from the cache. `ort_providers`:
    ONNX Runtime's execution providers (engines/providers.py); None: CPU, or CUDA on a CUDA device."""
    if engine == "onnxruntime":
        from .ort_runner import OrtRunner

        # On the CPU, as many threads as torch has been given (the model's `torch_threads` setting).
        return OrtRunner(onnx_path, spec, device, intra_op_threads=torch.get_num_threads(), providers=ort_providers)
    if engine == "openvino":
        from .openvino_runner import OpenVINORunner

        return OpenVINORunner(onnx_path, spec, device, precision=precision, threads=torch.get_num_threads())
    if engine == "tensorrt":
        from .trt_runner import TensorRTRunner

        if ranges is None:
            raise ValueError(f"{spec.name}: a TensorRT plan needs profile ranges")
        return TensorRTRunner(build_plan(onnx_path, spec, ranges, precision, cache_dir, device), spec, device)
    raise ValueError(f"open_runner runs ONNX graphs on 'onnxruntime', 'openvino' or 'tensorrt', not {engine!r}")


class RunnerHiFT(HiFTGenerator):
    """HiFTGenerator whose deterministic `decode(mel, source)` runs on a runner (graph `hift_decode`).

    F0 prediction and the harmonic source stay in torch. The generator's torch decode layers stay loaded
    (a few tens of MB) so that the module remains a complete HiFTGenerator."""

    decode_runner: Runner

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        return self.decode_runner(mel, source)


def build_token2wav(model_dir: str | Path, engine: str = "torch", device: str | torch.device = "cpu", *,
                    precision: str = "fp32", onnx_dir: str | Path | None = None,
                    cache_dir: str | Path | None = None, max_streams: int = 16,
                    max_seconds: float = 60.0, ort_providers: str | None = None,
                    flow_precision: str = "fp32") -> tuple[TokenToMel, Vocoder]:
    """(flow, hift) for `model_dir` with their heavy parts on `engine` (see the module docstring).

    precision: TensorRT and OpenVINO ("fp32", "fp16", "bf16"); torch and ONNX Runtime run fp32.
    max_streams / max_seconds: the TensorRT profile (flow rows per call, i.e. 2 * max_streams estimator
    rows, and mel length). ort_providers: see `open_runner`. flow_precision: the torch flow estimator's
    arithmetic, fp32 | bf16 | int8-dynamic | auto (models/flow.py, models/auto_precision.py); graph engines take `precision`."""
    from .onnx_export import token2wav_onnx  # the exporter loads only when a graph engine is used
    from .onnx_graphs import token2wav_specs

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    chosen = resolve_engine(engine, device)
    models = family_models(model_dir)
    if chosen != "torch" and not models.graphs:
        log.warning("engine %r runs CosyVoice2's token2wav graphs; this %s folder's token2wav runs on torch",
                    chosen, models.family)
        chosen = "torch"
    flow = models.load_flow(model_dir, device=device)
    if chosen == "torch":
        flow.decoder.set_precision(resolve_flow_precision(flow_precision, device))  # checks the name
        log.info("token2wav on torch (%s): flow estimator in %s", device, flow.decoder.precision)
        return flow, models.load_vocoder(model_dir, device=device)
    hift = RunnerHiFT.from_model_dir(model_dir, device=device)
    paths = token2wav_onnx(model_dir, onnx_dir)
    ranges = token2wav_dim_ranges(flow.config, max_streams, max_seconds,
                                  samples_per_frame=hift.config.samples_per_frame)
    runners = {name: open_runner(paths[name], spec, chosen, device, ranges=ranges[name], precision=precision,
                                 cache_dir=cache_dir, ort_providers=ort_providers)
               for name, spec in token2wav_specs(flow.config).items()}
    flow.encoder = RunnerModule(runners["flow_encoder"])
    flow.decoder.estimator = RunnerModule(runners["flow_estimator"])
    hift.decode_runner = runners["hift_decode"]
    log.info("token2wav on %s (%s): flow encoder, flow estimator and HiFT decode from %s", chosen, device,
             paths["flow_estimator"].parent)
    return flow, hift


def open_campplus(model_dir: str | Path, engine: str = "onnxruntime", device: str | torch.device = "cpu", *,
                  precision: str = "fp32", cache_dir: str | Path | None = None, max_batch: int = 16,
                  ort_providers: str | None = None) -> Runner:
    """CAM++ (`campplus.onnx`: fbank (B, T, 80) -> embedding (B, 192)) on `engine` and `device`.

    It ships as ONNX only, so its reference is ONNX Runtime ("torch" means "onnxruntime" here), and its
    last fallback is ONNX Runtime on the CPU, as the official frontend runs it (one warning line; the
    runner's `device` says where its outputs are). TensorRT plans are cached in `cache_dir` (default
    `<model_dir>/onnx/trt`)."""
    from .onnx_graphs import campplus_spec

    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    wanted = ("onnxruntime" if engine == "torch" else engine, torch.device(device))
    candidates = [wanted, ("onnxruntime", torch.device(device)), ("onnxruntime", torch.device("cpu"))]
    chosen = next(c for c in candidates if unavailable_reason(*c) is None)
    if chosen != wanted:
        log.warning("CAM++: engine %r is not available on %s (%s); using %r on %s", wanted[0], wanted[1],
                    unavailable_reason(*wanted), *chosen)
    path = ModelPaths(Path(model_dir)).campplus
    cache_dir = cache_dir if cache_dir is not None else Path(model_dir) / "onnx" / "trt"
    return open_runner(path, campplus_spec(), *chosen, ranges=campplus_dim_ranges(max_batch),
                       precision=precision, cache_dir=cache_dir, ort_providers=ort_providers)
