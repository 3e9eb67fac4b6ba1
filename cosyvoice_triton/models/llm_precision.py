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

Batch-invariant decode (on a CPU, every precision): a stream's logits at a decode step are the same bits
whatever else decodes beside it, and at any torch thread count, so a seed's tokens never depend on the load.
Batched, they were not (up to 2e-7 apart, enough to flip a sampled token now and then: one stream of a
64-stream burst did): the float kernels add a row's products in another order for one row than for several
(MKL's sgemm, oneDNN's bf16 gemm), the batched attention's products block the attended length differently
for another length, and SDPA's CPU kernel sums a head's float32 products in an order that depends on the
thread that runs it. So `SpeechLM.multiply_rows_apart` (from_model_dir on a CPU) makes a decode step
- multiply a batch's rows one at a time in the float Linears of the backbone (fp32, bf16) and in the speech
  head (`RowByRowLinear`); the int8 ones stay batched: ATen's int8 weight-only kernel and the per-row
  dynamic one reduce each row alone already;
- attend row by row, each row over its own written prefix, in float32 as plain products
  (`qwen2.row_attention`).
A prefill (one stream) is unchanged. tests/test_batch_invariance.py checks the bits for every precision on this
CPU's kernels and on its AVX2 kernels. GPUs (CUDA graphs, batched) and a compiled LLM (`--compile on`) keep
their batched decode: equal to a stream's solo run up to rounding only.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
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


class RowByRowLinear(nn.Linear):
    """nn.Linear that multiplies a decode step's rows (x (B, in) or (B, 1, in), B > 1) one at a time; other
    inputs (a prefill, a training batch (B, T, in)) in one call.

    The float kernels (MKL's sgemm, oneDNN's bf16 gemm) add a row's products in another order for one row
    than for several (measured on AVX512 with and without BF16: up to 1e-5 apart in float32, one bf16 step
    in bf16), so a stream's logits would depend on how many streams decode beside it. Row by row, each row
    is multiplied exactly as it is alone. The weights are the wrapped Linear's."""

    def forward(self, x: Tensor) -> Tensor:
        decode_rows = x.shape[0] > 1 and (x.dim() == 2 or (x.dim() == 3 and x.shape[1] == 1))
        if not decode_rows:
            return F.linear(x, self.weight, self.bias)
        return torch.cat([F.linear(row, self.weight, self.bias) for row in x.split(1)])


def row_by_row(linear: nn.Linear) -> RowByRowLinear:
    """`linear` as a RowByRowLinear sharing its parameters."""
    rows = RowByRowLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    rows.weight, rows.bias = linear.weight, linear.bias
    return rows


def multiply_rows_apart(module: nn.Module) -> None:
    """Replace every plain nn.Linear below `module` by its RowByRowLinear (the int8 ones stay: each reduces
    a row alone already)."""
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, row_by_row(child))
        else:
            multiply_rows_apart(child)


def multiply_rows_together(module: nn.Module) -> None:
    """Undo `multiply_rows_apart` below `module`: plain nn.Linears sharing the parameters again."""
    for name, child in module.named_children():
        if isinstance(child, RowByRowLinear):
            linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            linear.weight, linear.bias = child.weight, child.bias
            setattr(module, name, linear)
        else:
            multiply_rows_together(child)


def quantize_linears_dynamic(module: nn.Module) -> None:
    """Replace every nn.Linear below `module` by an Int8DynamicLinear (CPU)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8DynamicLinear(child))
        else:
            quantize_linears_dynamic(child)
