"""`auto` precision: the fastest precision whose quality holds, chosen from the device and the CPU's instructions.

Reduced precision pays only where the hardware computes it natively, and is a default only where its
quality holds. Measured on the full-size folder (perf/RESULTS.md, "Precision per CPU kind"):
- LLM: on CPUs with AVX512-BF16 (or AMX) the int8 weight-only backbone (bf16 activations) is fast and the
  closest to fp32 (mean KL 3.1e-5 <= 1e-3 nats per step): int8. Without bf16 instructions (AVX2, or
  AVX512 without BF16) bf16 and the weight-only int8 matmul are emulated and slower than fp32, but the
  quantized engine's dynamic int8 (`int8-dynamic`: fbgemm's native AVX2 / AVX512 kernels, mean KL 4.0e-4,
  within the bound) runs a full-size decode step 4.1x faster than fp32 on 2 quiet cores with AVX2 kernels
  (1.9x with a busy neighbour on one core): int8-dynamic there. (An earlier run at load 4-6 from
  unrelated work had it slower; both runs are in perf/RESULTS.md.) A CPU without AVX2 or without the x86
  quantized engine (ARM's qnnpack is unmeasured): fp32.
  On a GPU: bf16.
- Flow estimator: bf16 keeps the mel at 47 dB SNR after all 10 steps and int8-dynamic at 39 dB, but the
  vocoder turns either into a waveform at 8 dB (below the 30 dB bound for a default), so `auto` keeps the
  flow in fp32 everywhere; `bf16` and `int8-dynamic` (1.1x faster per flow solve with AVX2 kernels, 1.5x
  with AVX512-VNNI) are there for who measures them fine on their weights (perf/flow_quality.py).
`describe_cpu` names the CPU kind for the start-up line.
"""
from __future__ import annotations

import torch

from cosyvoice_triton.models.llm_precision import cpu_has_bf16


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    except AttributeError:
        return "unknown"


def describe_cpu() -> str:
    """The CPU kind that decides `auto`: e.g. "AVX512 with BF16" or "AVX2 without BF16"."""
    return f"{_capability()} {'with' if cpu_has_bf16() else 'without'} BF16"


def _on_gpu(device: str | torch.device) -> bool:
    return torch.device(device).type != "cpu"


def _has_x86_int8_kernels() -> bool:
    """fbgemm's kernels for the quantized engine: x86 with AVX2 or better."""
    engines = torch.backends.quantized.supported_engines
    return _capability().startswith(("AVX2", "AVX512")) and ("x86" in engines or "fbgemm" in engines)


def auto_llm_precision(device: str | torch.device = "cpu") -> str:
    if _on_gpu(device):
        return "bf16"
    if cpu_has_bf16():
        return "int8"
    return "int8-dynamic" if _has_x86_int8_kernels() else "fp32"


def auto_flow_precision(device: str | torch.device = "cpu") -> str:
    """fp32 on every device: bf16 and int8-dynamic miss the waveform bound (module docstring)."""
    return "fp32"


def resolve_llm_precision(precision: str, device: str | torch.device = "cpu") -> str:
    """`precision` as given, or what `auto` means on `device` here."""
    return auto_llm_precision(device) if precision == "auto" else precision


def resolve_flow_precision(precision: str, device: str | torch.device = "cpu") -> str:
    return auto_flow_precision(device) if precision == "auto" else precision


def resolved_precisions(llm_precision: str = "auto", flow_precision: str = "auto",
                        device: str | torch.device = "cpu") -> dict[str, str]:
    """What `auto` (or a named precision) resolves to here, for start-up lines and /readyz:
    {"llm": ..., "flow": ..., "cpu": describe_cpu()}."""
    return {"llm": resolve_llm_precision(llm_precision, device),
            "flow": resolve_flow_precision(flow_precision, device), "cpu": describe_cpu()}
