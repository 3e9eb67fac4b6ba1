"""Hardware beyond NVIDIA: ONNX Runtime execution providers and torch devices, checked at load.

ONNX Runtime providers come as one `--ort-providers` string, most preferred first, comma-separated,
each with its options after a colon as `key=value` pairs separated by semicolons:

    OpenVINOExecutionProvider:device_type=CPU;precision=FP32,CPUExecutionProvider
    openvino:device_type=GPU,rocm,cpu            (short names: `PROVIDER_NAMES`)

`choose_providers` keeps, in order, those that the installed onnxruntime has
(`onnxruntime.get_available_providers()`); the ones it lacks are named in one warning line that says
which package has them and which provider is used instead (once per process and list, not per graph). If it has none of them, that is an
`EngineUnavailable` naming what is missing. ONNX Runtime itself runs nodes that no listed provider
supports on the CPU provider.

torch devices: `check_torch_device("xpu:0")` returns the `torch.device` when torch knows the type and
its torch device module can run here, or raises `DeviceUnavailable` saying what is missing: an unknown type, a
plugin that is not installed (`npu` needs torch_npu, `hpu` habana_frameworks), or a device module with no
device.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import onnxruntime as ort
import torch

from ..errors import DeviceUnavailable, EngineUnavailable

log = logging.getLogger(__name__)
_warned: set[tuple[str, ...]] = set()  # provider lists whose fallback has been logged

# short name -> ONNX Runtime's provider name
PROVIDER_NAMES = {
    "openvino": "OpenVINOExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "cann": "CANNExecutionProvider",
    "directml": "DmlExecutionProvider",
    "dml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
# provider -> the pip package whose onnxruntime build has it
PROVIDER_PACKAGES = {
    "OpenVINOExecutionProvider": "onnxruntime-openvino",
    "ROCMExecutionProvider": "onnxruntime-rocm",
    "MIGraphXExecutionProvider": "onnxruntime-migraphx",
    "CANNExecutionProvider": "onnxruntime-cann",
    "DmlExecutionProvider": "onnxruntime-directml (Windows)",
    "CoreMLExecutionProvider": "onnxruntime (macOS)",
    "QNNExecutionProvider": "onnxruntime-qnn",
    "CUDAExecutionProvider": "onnxruntime-gpu",
    "TensorrtExecutionProvider": "onnxruntime-gpu",
    "CPUExecutionProvider": "onnxruntime",
}


@dataclass(frozen=True)
class Provider:
    """One execution provider and its options, as ONNX Runtime's `providers=[(name, options)]` takes it."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    def as_ort(self) -> tuple[str, dict[str, str]]:
        return self.name, dict(self.options)


def parse_providers(text: str) -> tuple[Provider, ...]:
    """`--ort-providers` -> providers in order of preference. Unknown names and malformed options are
    a ValueError naming the entry."""
    providers = []
    for entry in text.split(","):
        name, _, options = entry.strip().partition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"--ort-providers {text!r}: empty provider entry")
        full = PROVIDER_NAMES.get(name.lower(), name)
        if not full.endswith("ExecutionProvider"):
            raise ValueError(f"--ort-providers: unknown provider {name!r}; use an ONNX Runtime provider name "
                             f"(...ExecutionProvider) or one of {', '.join(PROVIDER_NAMES)}")
        pairs = []
        for option in filter(None, (o.strip() for o in options.split(";"))):
            key, eq, value = option.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"--ort-providers: option {option!r} of {full} is not key=value")
            pairs.append((key.strip(), value.strip()))
        providers.append(Provider(full, tuple(pairs)))
    return tuple(providers)


def choose_providers(wanted: tuple[Provider, ...] | str, available: list[str] | None = None) -> list[Provider]:
    """The providers of `wanted` that onnxruntime has here, in order; a warning line names the others."""
    if isinstance(wanted, str):
        wanted = parse_providers(wanted)
    available = ort.get_available_providers() if available is None else available
    usable = [p for p in wanted if p.name in available]
    missing = [p.name for p in wanted if p.name not in available]
    where = f"onnxruntime {ort.__version__} has {', '.join(available)}"
    packages = "; ".join(f"{name} comes with {PROVIDER_PACKAGES.get(name, 'a build of onnxruntime that has it')}"
                         for name in missing)
    if not usable:
        raise EngineUnavailable(f"none of the ONNX Runtime providers {', '.join(p.name for p in wanted)} is "
                                f"installed ({where}; {packages})")
    if missing and tuple(missing) not in _warned:
        _warned.add(tuple(missing))
        log.warning("ONNX Runtime providers %s are not available (%s; %s); using %s", ", ".join(missing), where,
                    packages, ", ".join(p.name for p in usable))
    return usable


# device type -> (module that registers it with torch, the package to install)
TORCH_PLUGINS = {
    "npu": ("torch_npu", "torch-npu (Ascend)"),
    "hpu": ("habana_frameworks.torch", "the Intel Gaudi PyTorch bridge (habana-torch-plugin)"),
    "musa": ("torch_musa", "torch_musa (Moore Threads)"),
    "mlu": ("torch_mlu", "torch_mlu (Cambricon)"),
}


def check_torch_device(name: str) -> torch.device:
    """`name` as a torch.device that can run here, or DeviceUnavailable saying what is missing."""
    kind = name.strip().split(":")[0]
    if kind in TORCH_PLUGINS:
        module, package = TORCH_PLUGINS[kind]
        try:
            importlib.import_module(module)  # registers the device type with torch
        except ImportError as exc:
            raise DeviceUnavailable(f"device {name!r} needs the torch plugin {package}, which is not "
                                    f"installed (import {module}: {exc})") from None
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        known = "cpu, cuda, xpu, mps, " + ", ".join(TORCH_PLUGINS)
        raise DeviceUnavailable(f"unknown torch device {name!r} (torch {torch.__version__}: "
                                f"{str(exc).splitlines()[0]}); known here: {known}") from None
    if device.type == "cpu":
        return device
    count = _device_count(device.type)
    if count == 0:
        raise DeviceUnavailable(f"device {name!r}: torch {torch.__version__} sees no {device.type} device "
                                f"(no driver, no hardware, or a torch build without {device.type})")
    if device.index is not None and count is not None and device.index >= count:
        raise DeviceUnavailable(f"device {name!r}: torch sees {count} {device.type} device(s)")
    return device


def _device_count(kind: str) -> int | None:
    """How many devices of `kind` torch can use (None: it has a device module but cannot count them)."""
    if kind == "mps":
        return int(torch.backends.mps.is_available())
    module = getattr(torch, kind, None)  # torch.cuda, torch.xpu, torch.npu once torch_npu is imported, ...
    if module is None or not hasattr(module, "is_available"):
        return 0
    if not module.is_available():
        return 0
    return module.device_count() if hasattr(module, "device_count") else None
