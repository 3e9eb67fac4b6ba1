"""OpenVINO runner: the same exported ONNX graph compiled by the OpenVINO runtime (`openvino.Core`).

Chosen over ONNX Runtime's OpenVINO execution provider because `onnxruntime-openvino` installs the
`onnxruntime` module itself (it replaces the `onnxruntime` wheel, the two cannot share an environment),
and because on this CPU the runtime ran the graphs at least as fast (perf/RESULTS.md). The provider stays
usable through `--engine onnxruntime --ort-providers openvino` where that wheel is installed.

Torch tensors go in and come out through numpy on the host; the output is copied out of OpenVINO's
buffer, which the next call overwrites. `ov_device` is OpenVINO's device ("CPU", "GPU" for Intel GPUs,
"NPU", "AUTO"); only "CPU" is tested here. precision sets `INFERENCE_PRECISION_HINT`: "fp32" (f32),
"bf16" or "fp16", each only where the device lists it in `OPTIMIZATION_CAPABILITIES` (an x86 CPU has
BF16 with AVX512-BF16 / AMX, FP16 with AMX-FP16); otherwise `EngineUnavailable` says what the device has.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import EngineUnavailable
from .base import GraphSpec, Runner, check_arity

# precision -> (INFERENCE_PRECISION_HINT, the OPTIMIZATION_CAPABILITIES entry it needs)
OPENVINO_PRECISIONS = {"fp32": ("f32", "FP32"), "bf16": ("bf16", "BF16"), "fp16": ("f16", "FP16")}
_DTYPES = {"f32": torch.float32, "f16": torch.float16, "i64": torch.int64, "i32": torch.int32,
           "boolean": torch.bool}


def import_openvino():
    try:
        import openvino
    except ImportError as exc:
        raise EngineUnavailable(f"the openvino package is not installed (pip install "
                                f"'cosyvoice-triton[openvino]'): {exc}") from None
    return openvino


def openvino_unavailable_reason() -> str | None:
    """Why OpenVINO cannot run here, or None."""
    try:
        import_openvino()
    except EngineUnavailable as exc:
        return str(exc)
    return None


def compile_config(core, ov_device: str, precision: str, threads: int) -> dict[str, str]:
    """compile_model properties: precision hint (checked against the device), latency mode, `threads`."""
    if precision not in OPENVINO_PRECISIONS:
        raise ValueError(f"OpenVINO precision must be one of {sorted(OPENVINO_PRECISIONS)}, got {precision!r}")
    hint, capability = OPENVINO_PRECISIONS[precision]
    if ov_device.split(".")[0] not in core.available_devices:
        raise EngineUnavailable(f"OpenVINO has no device {ov_device!r} here (it has {core.available_devices})")
    capabilities = core.get_property(ov_device, "OPTIMIZATION_CAPABILITIES")
    if capability not in capabilities:
        raise EngineUnavailable(f"OpenVINO {ov_device} here cannot compute in {precision}: it offers "
                                f"{', '.join(capabilities)}")
    config = {"INFERENCE_PRECISION_HINT": hint, "PERFORMANCE_HINT": "LATENCY"}
    if ov_device == "CPU" and threads > 0:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    return config


class OpenVINORunner(Runner):
    engine = "openvino"

    def __init__(self, path: str | Path, spec: GraphSpec, device: str | torch.device = "cpu", *,
                 precision: str = "fp32", ov_device: str = "CPU", threads: int = 1):
        ov = import_openvino()
        self.spec = spec
        self.device = torch.device(device)  # where outputs go; OpenVINO works on host memory
        self.precision = precision
        core = ov.Core()
        model = core.read_model(str(path))
        declared = {port.get_any_name(): port.get_element_type().get_type_name()
                    for port in [*model.inputs, *model.outputs]}
        if set(declared) != {*spec.inputs, spec.output}:
            raise ValueError(f"{path}: graph tensors {sorted(declared)} != {spec.name}'s "
                             f"{sorted({*spec.inputs, spec.output})}")
        self.dtypes = {name: _DTYPES[kind] for name, kind in declared.items()}
        self.compiled = core.compile_model(model, ov_device, compile_config(core, ov_device, precision, threads))
        self.request = self.compiled.create_infer_request()

    def __call__(self, *inputs: Tensor) -> Tensor:
        check_arity(self.spec, inputs)
        feeds = {name: x.detach().to("cpu", self.dtypes[name]).contiguous().numpy()
                 for name, x in zip(self.spec.inputs, inputs)}
        self.request.infer(feeds)
        output = np.array(self.request.get_tensor(self.spec.output).data, copy=True)
        return torch.from_numpy(output).to(self.device)
