"""The runner interface: one exported graph, run by one engine, tensors in and one tensor out.

Every heavy module has a torch path (the reference) and may run in ONNX Runtime or TensorRT instead.
A `Runner` hides which: it is called with torch tensors in the order of its `GraphSpec.inputs`, on the
runner's device, and returns the graph's single output as a torch tensor on that device, so a runner can
stand in for the torch module it was exported from (`RunnerModule`).

Engine names: "torch", "onnxruntime", "openvino", "tensorrt" (`ENGINES`, most portable first).
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

ENGINES = ("torch", "onnxruntime", "openvino", "tensorrt")
PRECISIONS = ("fp32", "fp16", "bf16")  # of TensorRT builds and OpenVINO's hint; ONNX Runtime and torch run fp32

Shapes = Sequence[tuple[int, ...]]


@dataclass(frozen=True)
class GraphSpec:
    """The contract of one graph, shared by its exporter and every engine that runs it.

    name: the ONNX file stem. inputs: input names in call order. output: the one output's name.
    dynamic_axes: per tensor, axis -> symbolic name (batch and time axes).
    output_shape: output shape from the input shapes (engines that preallocate the output need it).
    """

    name: str
    inputs: tuple[str, ...]
    output: str
    dynamic_axes: Mapping[str, Mapping[int, str]]
    output_shape: Callable[[Shapes], tuple[int, ...]]


class Runner(ABC):
    """One graph on one engine and device. Not thread-safe: one caller at a time."""

    engine: str  # one of ENGINES
    spec: GraphSpec
    device: torch.device

    @abstractmethod
    def __call__(self, *inputs: Tensor) -> Tensor:
        """Inputs in `spec.inputs` order (cast to the graph's dtypes as needed) -> the output on `device`."""


class RunnerModule(nn.Module):
    """A runner in the place of the torch submodule it was exported from (same positional call)."""

    def __init__(self, runner: Runner):
        super().__init__()
        self.runner = runner

    def forward(self, *inputs: Tensor) -> Tensor:
        return self.runner(*inputs)

    def extra_repr(self) -> str:
        return f"{self.runner.spec.name} on {self.runner.engine} ({self.runner.device})"


def check_arity(spec: GraphSpec, inputs: Sequence[Tensor]) -> None:
    if len(inputs) != len(spec.inputs):
        raise TypeError(f"{spec.name} takes {len(spec.inputs)} inputs {spec.inputs}, got {len(inputs)}")


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (graphs and checkpoints are identified by it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()
