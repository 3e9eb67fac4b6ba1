"""Open ONNX Runtime sessions with one set of options for the whole project.

CPU sessions use a fixed, small thread pool so that several model instances in one server do not
fight over cores. The CUDA provider is used when the installed onnxruntime has it and the caller
does not ask for the CPU; the CPU provider always stays as the fallback for unsupported nodes.
`providers` (a `--ort-providers` string, engines/providers.py) replaces that choice: OpenVINO, ROCm,
MIGraphX, CANN, DirectML, ... in order of preference, each with its options, checked at load.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import onnxruntime as ort

from cosyvoice_triton.errors import ModelFolderError

Device = Literal["auto", "cpu", "cuda"]

CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"


def session_options(intra_op_threads: int = 1) -> ort.SessionOptions:
    """Full graph optimization, sequential execution, `intra_op_threads` threads per session."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only
    return options


def providers_for(device: Device) -> list[str]:
    """Execution providers, most preferred first. `cuda` fails loudly when CUDA is not available."""
    available = ort.get_available_providers()
    if device == "cpu":
        return [CPU_PROVIDER]
    if CUDA_PROVIDER in available:
        return [CUDA_PROVIDER, CPU_PROVIDER]
    if device == "cuda":
        raise RuntimeError(f"onnxruntime has no {CUDA_PROVIDER}; installed providers: {available}")
    return [CPU_PROVIDER]


def open_session(path: str | Path, device: Device = "auto", intra_op_threads: int = 1,
                 providers: str | None = None) -> ort.InferenceSession:
    """An inference session for the ONNX file at `path`, on `providers` if given, else on `device`'s."""
    from .providers import choose_providers

    path = Path(path)
    if not path.is_file():
        raise ModelFolderError(f"ONNX model not found: {path}")
    chosen = [p.as_ort() for p in choose_providers(providers)] if providers else providers_for(device)
    return ort.InferenceSession(str(path), sess_options=session_options(intra_op_threads), providers=chosen)


def input_names(session: ort.InferenceSession) -> list[str]:
    """The session's input names in graph order."""
    return [node.name for node in session.get_inputs()]
