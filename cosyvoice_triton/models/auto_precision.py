"""`auto` precision: the fastest precision whose quality holds, chosen from the device and the CPU's instructions.

Reduced precision pays only where the hardware computes it natively, and is a default only where its
quality holds. Measured on the full-size folder (perf/RESULTS.md, "Precision per CPU kind"):
- LLM: on CPUs with AVX512-BF16 (or AMX) the int8 weight-only backbone (bf16 activations) is fast and the
  closest to fp32 (mean KL 3.1e-5 <= 1e-3 nats per step): int8. Without bf16 instructions (AVX2, or
  AVX512 without BF16) bf16 is emulated and the weight-only int8 matmul is slower than fp32. The quantized
  engine's dynamic int8 (`int8-dynamic`, within the bound: mean KL 4.0e-4) has native AVX2 kernels and its
  Linear calls alone are faster than fp32's, but a whole decode step measured 3.5x slower than fp32's
  (median, 2 busy cores; its best step 0.5x) with AVX2 kernels: on a CPU shared with other work, as a
  served LLM always is (token2wav beside it), it loses. So fp32 there, int8-dynamic offered by name.
  On a GPU: bf16.
- Flow estimator: bf16 keeps the mel at 47 dB SNR after all 10 steps, but the vocoder turns that into a
  waveform at 8 dB (below the 30 dB bound for a default), so `auto` keeps the flow in fp32 everywhere;
  `bf16` is there for who measures it fine on their weights (perf/flow_quality.py).
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


def auto_llm_precision(device: str | torch.device = "cpu") -> str:
    if _on_gpu(device):
        return "bf16"
    return "int8" if cpu_has_bf16() else "fp32"


def auto_flow_precision(device: str | torch.device = "cpu") -> str:
    """fp32 on every device: bf16 misses the waveform bound (module docstring)."""
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
