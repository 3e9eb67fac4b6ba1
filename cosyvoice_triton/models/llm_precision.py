"""Reduced-precision variants of the speech LM's backbone: `fp32` (the reference), `bf16`, `int8`.

- bf16: weights and activations in bfloat16 (fast on CPUs with AVX512-BF16/AMX and on GPUs); norms,
  rotary embedding and the speech head stay in float32.
- int8: the backbone's Linear weights quantized per output channel (symmetric, weight-only; one float
  scale per row) and run by ATen's int8-weight matmul; activations in bfloat16 where the CPU has bf16
  instructions (or on a GPU), else float32. Embeddings, norms and the speech head as in bf16.
Quality against fp32 is measured by perf/llm_quality.py (mean per-step KL, top-1 agreement).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

LLM_PRECISIONS = ("fp32", "bf16", "int8")


def check_llm_precision(precision: str) -> str:
    if precision not in LLM_PRECISIONS:
        raise ValueError(f"llm precision must be one of {', '.join(LLM_PRECISIONS)}, got {precision!r}")
    return precision


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX512-BF16 or AMX); without them bf16 is emulated."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def describe_backbone(llm) -> str:
    """What a SpeechLM's backbone runs in, read from its modules: precision, compute dtype, int8 layers."""
    int8 = sum(isinstance(module, Int8WeightOnlyLinear) for module in llm.backbone.modules())
    dtype = str(llm.llm_embedding.weight.dtype).removeprefix("torch.")
    return f"{llm.precision} (computes in {dtype}; {int8} int8 weight-only Linear layers)"


def activation_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the backbone computes in for `precision` on `device`."""
    if precision == "fp32":
        return torch.float32
    if precision == "int8" and device.type == "cpu" and not cpu_has_bf16():
        return torch.float32
    return torch.bfloat16


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (scale * W_int8).T + bias, W_int8 (out, in) int8, scale (out,): per-channel weight-only."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        weight = linear.weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (out,)
        self.register_buffer("weight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out) in x's dtype."""
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight, self.scale)  # (N, out)
        y = y.reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def quantize_linears(module: nn.Module, dtype: torch.dtype) -> None:
    """Replace every nn.Linear below `module` by an Int8WeightOnlyLinear computing in `dtype`."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8WeightOnlyLinear(child, dtype))
        else:
            quantize_linears(child, dtype)
