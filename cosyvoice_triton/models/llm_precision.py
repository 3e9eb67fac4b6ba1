"""Reduced-precision variants of the speech LM's backbone: `fp32` (the reference), `bf16`, `int8`, `int8-dynamic`.

- bf16: weights and activations in bfloat16 (fast on CPUs with AVX512-BF16/AMX and on GPUs); norms,
  rotary embedding and the speech head stay in float32.
- int8: the backbone's Linear weights quantized per output channel (symmetric, weight-only; one float
  scale per row) and run by ATen's int8-weight matmul; activations in bfloat16 where the CPU has bf16
  instructions (or on a GPU), else float32. Embeddings, norms and the speech head as in bf16.
- int8-dynamic: the backbone's Linear weights quantized per output channel (symmetric int8, as in int8) and
  each stream's activations quantized to uint8 on the fly (one scale per stream and call, 7-bit range),
  multiplied in
  integers by PyTorch's quantized engine (fbgemm / x86: native AVX2 and AVX512-VNNI kernels). Everything
  else, and the Linear outputs, in float32. CPU only. The fastest on CPUs without bf16 instructions
  (perf/RESULTS.md, "int8 on every CPU"); `int8` stays for CPUs with bf16 and for GPUs.
Quality against fp32 is measured by perf/llm_quality.py (mean per-step KL, top-1 agreement).
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

LLM_PRECISIONS = ("fp32", "bf16", "int8", "int8-dynamic")


def check_llm_precision(precision: str) -> str:
    if precision not in LLM_PRECISIONS:
        raise ValueError(f"llm precision must be one of {', '.join(LLM_PRECISIONS)}, got {precision!r}")
    return precision


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX, and ATen's kernels allowed AVX512:
    ATEN_CPU_CAPABILITY=avx2 caps them, which perf/ uses to measure an AVX2 CPU); else bf16 is emulated."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def describe_backbone(llm) -> str:
    """What a SpeechLM's backbone runs in, read from its modules: precision, compute dtype, int8 layers."""
    int8 = sum(isinstance(module, Int8WeightOnlyLinear) for module in llm.backbone.modules())
    dynamic = sum(isinstance(module, Int8DynamicLinear) for module in llm.backbone.modules())
    dtype = str(llm.speech_embedding.weight.dtype).removeprefix("torch.")
    layers = f"{dynamic} int8 dynamic Linear layers ({torch.backends.quantized.engine})" if dynamic \
        else f"{int8} int8 weight-only Linear layers"
    return f"{llm.precision} (computes in {dtype}; {layers})"


def activation_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the backbone computes in for `precision` on `device`."""
    if precision in ("fp32", "int8-dynamic"):
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


class Int8DynamicLinear(nn.Module):
    """y = dequant(quant(x) @ W_int8.T) + bias: per-channel int8 weights (as Int8WeightOnlyLinear's), the
    activations quantized per call by the quantized engine (its `linear_dynamic` op, packed weights).

    The weights are packed for torch.backends.quantized.engine at construction (x86 / fbgemm on x86 CPUs).
    reduce_range=True quantizes activations to 7 bits, as torch.ao's dynamic Linear does: fbgemm's AVX2
    kernel adds pairs of uint8 x int8 products in int16, which 8-bit activations can saturate."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (out,)
        zero = torch.zeros_like(scale, dtype=torch.int64)
        with warnings.catch_warnings():  # quantized tensors are deprecated; their packed-weight ops are not
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scale.double(), zero, axis=0, dtype=torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.out_features = weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T, in) float32 -> (B, T, out) float32, each batch row quantized on its own.

        The activation scale spans the whole input of a call, so one call for a batch of streams would
        make a stream's numbers depend on its neighbours (and its sampled tokens on the batch): one call
        per stream instead (B is 1 in a prefill)."""
        if x.dim() < 3 or x.shape[0] == 1:
            return torch.ops.quantized.linear_dynamic(x, self.packed, True)
        return torch.stack([torch.ops.quantized.linear_dynamic(row, self.packed, True) for row in x])


def quantize_linears_dynamic(module: nn.Module) -> None:
    """Replace every nn.Linear below `module` by an Int8DynamicLinear (CPU)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8DynamicLinear(child))
        else:
            quantize_linears_dynamic(child)
