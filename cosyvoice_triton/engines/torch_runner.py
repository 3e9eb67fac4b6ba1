"""torch runners: the reference (eager), and a torch callable replayed from a CUDA graph.

`TorchRunner` calls the torch module a graph is exported from, so the three engines can be driven and
compared through one interface. `CudaGraphCall` captures any torch callable (one estimator step, the
whole 10-step loop, the vocoder) once for fixed input shapes and replays it: no Python or kernel-launch
overhead, for callers that keep their shapes fixed (benchmarks, or a server that pads to a few sizes).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from .base import GraphSpec, Runner, check_arity


class TorchRunner(Runner):
    engine = "torch"

    def __init__(self, module: nn.Module | Callable[..., Tensor], spec: GraphSpec, device: str | torch.device):
        self.module = module
        self.spec = spec
        self.device = torch.device(device)

    @torch.inference_mode()
    def __call__(self, *inputs: Tensor) -> Tensor:
        check_arity(self.spec, inputs)
        return self.module(*(x.to(self.device) for x in inputs))


class CudaGraphCall:
    """`fn` captured for the shapes of `example_inputs`. A call copies its inputs into the captured
    buffers and replays; the output tensor is the captured one, overwritten by the next call."""

    def __init__(self, fn: Callable[..., Tensor], example_inputs: tuple[Tensor, ...], warmup: int = 2,
                 pool: tuple | None = None):
        """`pool` (`torch.cuda.graph_pool_handle()`): memory shared with other graphs of that pool, for graphs
        replayed one at a time whose outputs are read before the next replay."""
        self.device = example_inputs[0].device
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need CUDA tensors, got {self.device}")
        self.static_inputs = tuple(x.clone() for x in example_inputs)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)  # warm-up off the capture stream, as torch asks
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn(*self.static_inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            with torch.cuda.graph(self.graph, pool=pool):
                self.static_output = fn(*self.static_inputs)

    def __call__(self, *inputs: Tensor) -> Tensor:
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"captured with {len(self.static_inputs)} inputs, got {len(inputs)}")
        for buffer, x in zip(self.static_inputs, inputs):
            if x.shape != buffer.shape:
                raise ValueError(f"captured for {tuple(buffer.shape)}, got {tuple(x.shape)}")
            buffer.copy_(x)
        self.graph.replay()
        return self.static_output
