"""TensorRT runner: a serialized engine, one execution context, torch tensors in and out.

A call sets the input shapes and addresses, allocates the output from torch's caching allocator with
the shape TensorRT infers, and enqueues the engine with `execute_async_v3` on the runner's own CUDA
stream, which waits for the caller's stream and is waited for by it: no host synchronisation, so the
10 Euler steps of the flow are queued back to back. (The runner has a stream of its own because TensorRT
synchronises the host when enqueued on the legacy default stream, which is torch's current stream unless
the caller picked another.)
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import EngineUnavailable
from .base import GraphSpec, Runner, check_arity
from .trt_build import import_tensorrt


def _torch_dtypes(trt) -> dict:
    return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
            trt.int32: torch.int32, trt.int64: torch.int64, trt.bool: torch.bool}


class TensorRTRunner(Runner):
    engine = "tensorrt"

    def __init__(self, engine_path: str | Path, spec: GraphSpec, device: str | torch.device = "cuda"):
        trt = import_tensorrt()
        self.spec = spec
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise EngineUnavailable(f"TensorRT needs a CUDA device; got {self.device} "
                                    f"(CUDA available: {torch.cuda.is_available()})")
        self.logger = trt.Logger(trt.Logger.WARNING)
        with torch.cuda.device(self.device):
            self.trt_engine = trt.Runtime(self.logger).deserialize_cuda_engine(Path(engine_path).read_bytes())
            if self.trt_engine is None:
                raise RuntimeError(f"TensorRT {trt.__version__} cannot load {engine_path} (built by another "
                                   "TensorRT version or for another GPU?); delete it to rebuild")
            self.context = self.trt_engine.create_execution_context()
            self.stream = torch.cuda.Stream(self.device)
        names = [self.trt_engine.get_tensor_name(i) for i in range(self.trt_engine.num_io_tensors)]
        if set(names) != {*spec.inputs, spec.output}:
            raise ValueError(f"{engine_path}: engine tensors {sorted(names)} != {spec.name}'s "
                             f"{sorted({*spec.inputs, spec.output})}")
        dtypes = _torch_dtypes(trt)
        self.dtypes = {name: dtypes[self.trt_engine.get_tensor_dtype(name)] for name in names}

    def __call__(self, *inputs: Tensor) -> Tensor:
        check_arity(self.spec, inputs)
        with torch.cuda.device(self.device):  # TensorRT enqueues on the current device: make it the engine's
            return self._run(inputs)

    def _run(self, inputs: tuple[Tensor, ...]) -> Tensor:
        caller = torch.cuda.current_stream(self.device)
        tensors = [x.detach().to(self.device, self.dtypes[name]).contiguous()
                   for name, x in zip(self.spec.inputs, inputs)]
        for name, x in zip(self.spec.inputs, tensors):
            if not self.context.set_input_shape(name, tuple(x.shape)):
                low, _, high = self.trt_engine.get_tensor_profile_shape(name, 0)
                raise ValueError(f"{self.spec.name}: input {name} of shape {tuple(x.shape)} is outside the "
                                 f"engine's profile [{tuple(low)}, {tuple(high)}]")
            self.context.set_tensor_address(name, x.data_ptr())
        output = torch.empty(tuple(self.context.get_tensor_shape(self.spec.output)),
                             dtype=self.dtypes[self.spec.output], device=self.device)
        self.context.set_tensor_address(self.spec.output, output.data_ptr())
        self.stream.wait_stream(caller)  # the inputs are written on the caller's stream
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"{self.spec.name}: TensorRT failed to enqueue the engine; see its log")
        for x in (*tensors, output):
            x.record_stream(self.stream)  # torch's allocator must not hand this memory out before we finish
        caller.wait_stream(self.stream)
        return output
