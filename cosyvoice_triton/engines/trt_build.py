"""TensorRT plans from the ONNX graphs: optimization profiles, building, and an on-disk cache.

An engine only runs on the GPU model and TensorRT version that built it, for the shapes of its profile.
The cache file name therefore carries a key over the GPU name, the TensorRT version, the ONNX file's
sha256, the precision and the profile; a file with the right key is loaded, anything else is built (and
written atomically, so concurrent builders never see half a file).

Profiles are given per symbolic dimension (`DimRanges`: name -> (min, opt, max)) and applied to every
input that uses that name in its `GraphSpec.dynamic_axes`; the other dimensions are the graph's static
ones. token2wav's ranges (`token2wav_dim_ranges`) cover up to `max_streams` streams per flow call, i.e.
2 * max_streams rows in the guided estimator batch, and up to `max_seconds` of mel, prompt included.

Precision: every engine is built strongly typed, so the types written in the graph decide (the only
mode TensorRT 11 has; TensorRT 10 takes the same flag). "fp32" builds the exported graph as it is, with
TF32 off, so parity with torch is tight. "fp16" / "bf16" build the graph's `mixed_precision` copy
(`onnx_precision.py`): matrix products and convolutions in reduced precision, the rest and the I/O fp32.

`tensorrt` is imported only when an engine is built or loaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Mapping, Sequence

import onnx
import torch

from ..models.flow import FlowConfig
from ..errors import EngineUnavailable
from .base import PRECISIONS, GraphSpec, sha256_file
from .onnx_precision import LOW_PRECISION_OPS, mixed_precision

log = logging.getLogger(__name__)

DimRanges = Mapping[str, tuple[int, int, int]]  # symbolic dim -> (min, opt, max)
ProfileShapes = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # input -> (min, opt, max)

MEL_FRAMES_PER_SECOND = 50
FBANK_FRAMES_PER_SECOND = 100  # CAM++ input: Kaldi fbank, 10 ms shift


def import_tensorrt():
    """The `tensorrt` module, or EngineUnavailable saying how to get it."""
    try:
        import tensorrt
    except ImportError as error:
        raise EngineUnavailable("the tensorrt Python package is not installed (pip install tensorrt, "
                                "or the project's [gpu] extra)") from error
    return tensorrt


def token2wav_dim_ranges(config: FlowConfig, max_streams: int = 16, max_seconds: float = 60.0,
                         opt_streams: int = 4, opt_seconds: float = 8.0, samples_per_frame: int = 480
                         ) -> dict[str, DimRanges]:
    """Profile ranges of the three token2wav graphs (see the module docstring)."""
    max_frames = int(max_seconds * MEL_FRAMES_PER_SECOND)
    opt_frames = int(opt_seconds * MEL_FRAMES_PER_SECOND)
    ratio, lookahead = config.token_mel_ratio, config.pre_lookahead_len
    streams = (1, opt_streams, max_streams)
    return {
        "flow_estimator": {"B": (2, 2 * opt_streams, 2 * max_streams), "T": (1, opt_frames, max_frames)},
        "flow_encoder": {"B": streams,
                         "W": (1 + lookahead, opt_frames // ratio + lookahead, max_frames // ratio + lookahead)},
        "hift_decode": {"B": streams, "T": (1, opt_frames, max_frames),
                        "L": (samples_per_frame, opt_frames * samples_per_frame, max_frames * samples_per_frame)},
    }


def campplus_dim_ranges(max_batch: int = 16, max_seconds: float = 30.0) -> DimRanges:
    """CAM++ on up to `max_batch` prompts of up to `max_seconds` (the prompt audio limit)."""
    max_frames = int(max_seconds * FBANK_FRAMES_PER_SECOND)
    return {"B": (1, 1, max_batch), "T": (16, 5 * FBANK_FRAMES_PER_SECOND, max_frames)}


def profile_shapes(spec: GraphSpec, input_shapes: Mapping[str, Sequence[int]], ranges: DimRanges) -> ProfileShapes:
    """(min, opt, max) shape per input: the spec's dynamic axes take their symbol's range, the rest their
    static size. `input_shapes` holds each input's shape as the network declares it (-1 where dynamic)."""
    profiles = {}
    for name, shape in input_shapes.items():
        axes = spec.dynamic_axes.get(name, {})
        bounds = []
        for axis, size in enumerate(shape):
            if axis in axes:
                bounds.append(ranges[axes[axis]])
            elif size < 0:
                raise ValueError(f"{spec.name}: input {name} axis {axis} is dynamic in the graph but not in the spec")
            else:
                bounds.append((size, size, size))
        profiles[name] = tuple(tuple(b[i] for b in bounds) for i in range(3))
    return profiles


def plan_cache_key(onnx_sha256: str, gpu_name: str, trt_version: str, precision: str,
                     profiles: ProfileShapes) -> str:
    """A hex key that changes with anything an engine depends on."""
    identity = {"onnx": onnx_sha256, "gpu": gpu_name, "tensorrt": trt_version, "precision": precision,
                "profile": {name: [list(s) for s in shapes] for name, shapes in sorted(profiles.items())}}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def plan_file(cache_dir: str | Path, onnx_path: str | Path, precision: str, key: str) -> Path:
    return Path(cache_dir) / f"{Path(onnx_path).stem}.{precision}.{key[:16]}.plan"


def declared_input_shapes(onnx_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each graph input's shape as the ONNX file declares it, -1 on dynamic axes."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return {x.name: tuple(d.dim_value if d.HasField("dim_value") else -1 for d in x.type.tensor_type.shape.dim)
            for x in graph.input}


def build_plan(onnx_path: str | Path, spec: GraphSpec, ranges: DimRanges, precision: str = "fp32",
                 cache_dir: str | Path | None = None, device: str | torch.device = "cuda",
                 optimization_level: int | None = None) -> Path:
    """The engine file for `onnx_path` on this GPU: from the cache (default `<onnx dir>/trt`), or built."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    trt = import_tensorrt()
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise EngineUnavailable(f"TensorRT needs a CUDA device; got {device} (CUDA available: "
                                f"{torch.cuda.is_available()})")
    onnx_path = Path(onnx_path)
    cache_dir = Path(cache_dir) if cache_dir is not None else onnx_path.parent / "trt"
    profiles = profile_shapes(spec, declared_input_shapes(onnx_path), ranges)
    # The reduced-precision graph is made from the ONNX file by the LOW_PRECISION_OPS policy: key on both.
    recipe = precision if precision == "fp32" else f"{precision}:{','.join(LOW_PRECISION_OPS)}"
    gpu = torch.cuda.get_device_name(device)
    path = plan_file(cache_dir, onnx_path, precision,
                       plan_cache_key(sha256_file(onnx_path), gpu, trt.__version__, recipe, profiles))
    if path.exists():
        return path
    log.info("building TensorRT %s engine for %s (profile %s)", precision, onnx_path.name, profiles)
    with torch.cuda.device(device):
        serialized = _build(trt, onnx_path, precision, profiles, optimization_level)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(serialized)
    os.replace(partial, path)
    path.with_suffix(".json").write_text(json.dumps(
        {"onnx": onnx_path.name, "gpu": gpu, "tensorrt": trt.__version__, "precision": recipe,
         "profile": profiles}, indent=2) + "\n")
    return path


def _build(trt, onnx_path: Path, precision: str, profiles: ProfileShapes, optimization_level: int | None) -> bytes:
    """A serialized engine: strongly typed, one optimization profile."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_strongly_typed_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if precision == "fp32":
        parsed = parser.parse_from_file(str(onnx_path))
    else:
        parsed = parser.parse(mixed_precision(onnx.load(str(onnx_path)), precision).SerializeToString())
    if not parsed:
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path} ({precision}): {errors}")
    config = builder.create_builder_config()
    if hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32, matrix products included
    if optimization_level is not None:
        config.builder_optimization_level = optimization_level
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in profiles.items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT could not build {onnx_path} ({precision}); see its log above")
    return bytes(serialized)


def _strongly_typed_flags(trt) -> int:
    """Network creation flags: strongly typed (TensorRT 10 asks for it; 11 always is and may drop the flag)."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)
