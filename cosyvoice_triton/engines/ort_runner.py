"""ONNX Runtime runner, on the CPU, with the CUDA execution provider, or on the execution providers of
a `--ort-providers` list (OpenVINO, ROCm, CANN, ...: engines/providers.py; inputs and outputs on the host).

CPU: torch tensors go in and come out through numpy (no copies for contiguous tensors).

CUDA: inputs and the output stay on the GPU (IOBinding on the tensors' memory; the output is preallocated
from `GraphSpec.output_shape`). ONNX Runtime runs on a stream of its own, handed to it as
`user_compute_stream` (torch's legacy default stream has handle 0, which ONNX Runtime refuses), and is
ordered after the caller's stream and before it again with stream waits, not host syncs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor

from .base import GraphSpec, Runner, check_arity
from .onnx_session import CPU_PROVIDER, CUDA_PROVIDER, open_session, session_options

# ONNX Runtime type strings -> (torch dtype, numpy dtype)
_DTYPES = {"tensor(float)": (torch.float32, np.float32), "tensor(float16)": (torch.float16, np.float16),
           "tensor(int64)": (torch.int64, np.int64), "tensor(int32)": (torch.int32, np.int32),
           "tensor(bool)": (torch.bool, np.bool_)}


class OrtRunner(Runner):
    engine = "onnxruntime"

    def __init__(self, path: str | Path, spec: GraphSpec, device: str | torch.device = "cpu",
                 intra_op_threads: int = 1, providers: str | None = None):
        self.spec = spec
        self.device = torch.device(device)
        if self.device.type == "cuda" and providers:
            raise ValueError(f"{spec.name}: ort_providers {providers!r} run on host memory; on {self.device} "
                             "ONNX Runtime uses its CUDA provider with IOBinding (leave ort_providers empty)")
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.session = self._cuda_session(Path(path), intra_op_threads)
            self.run_options = ort.RunOptions()
            # The caller's stream waits for ours; a host sync at the end of every run is not needed.
            self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        else:
            self.session = open_session(path, "cpu", intra_op_threads, providers)
        declared = {node.name: node.type for node in [*self.session.get_inputs(), *self.session.get_outputs()]}
        if set(declared) != {*spec.inputs, spec.output}:
            raise ValueError(f"{path}: graph tensors {sorted(declared)} != {spec.name}'s "
                             f"{sorted({*spec.inputs, spec.output})}")
        self.dtypes = {name: _DTYPES[kind] for name, kind in declared.items()}

    def _cuda_session(self, path: Path, intra_op_threads: int) -> ort.InferenceSession:
        if CUDA_PROVIDER not in ort.get_available_providers():
            raise RuntimeError(f"onnxruntime {ort.__version__} has no {CUDA_PROVIDER} (install onnxruntime-gpu)")
        cuda_options = {"device_id": str(self.device.index or 0), "user_compute_stream": str(self.stream.cuda_stream)}
        return ort.InferenceSession(str(path), sess_options=session_options(intra_op_threads),
                                    providers=[(CUDA_PROVIDER, cuda_options), CPU_PROVIDER])

    def __call__(self, *inputs: Tensor) -> Tensor:
        check_arity(self.spec, inputs)
        if self.device.type == "cuda":
            return self._run_cuda(inputs)
        feeds = {name: x.detach().to("cpu", self.dtypes[name][0]).contiguous().numpy()
                 for name, x in zip(self.spec.inputs, inputs)}
        (output,) = self.session.run([self.spec.output], feeds)
        return torch.from_numpy(output).to(self.device)

    def _run_cuda(self, inputs: tuple[Tensor, ...]) -> Tensor:
        caller = torch.cuda.current_stream(self.device)
        tensors = [x.detach().to(self.device, self.dtypes[name][0]).contiguous()
                   for name, x in zip(self.spec.inputs, inputs)]
        out_dtype, out_np = self.dtypes[self.spec.output]
        output = torch.empty(self.spec.output_shape([tuple(x.shape) for x in tensors]), dtype=out_dtype,
                             device=self.device)
        binding = self.session.io_binding()
        index = self.device.index or 0
        for name, x in zip(self.spec.inputs, tensors):
            binding.bind_input(name, "cuda", index, self.dtypes[name][1], tuple(x.shape), x.data_ptr())
        binding.bind_output(self.spec.output, "cuda", index, out_np, tuple(output.shape), output.data_ptr())
        self.stream.wait_stream(caller)  # the inputs are written on the caller's stream
        self.session.run_with_iobinding(binding, self.run_options)
        for x in (*tensors, output):
            x.record_stream(self.stream)  # torch's allocator must not hand this memory out before we finish
        caller.wait_stream(self.stream)
        return output
