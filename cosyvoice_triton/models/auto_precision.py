"""`auto` precision: the fastest precision whose quality holds, chosen from the device and the CPU's instructions.

Reduced precision pays only where the hardware computes it natively, and is a default only where its
quality holds. Measured on the full-size folder (perf/RESULTS.md, "Precision per CPU kind"):
- LLM: on CPUs with AVX512-BF16 (or AMX) the int8 weight-only backbone (bf16 activations) is the fastest
  and within the bound (mean KL 4.1e-6 <= 1e-3 nats per step); without bf16 instructions (AVX2-only,
  AVX512 without BF16) bf16 is emulated and the int8 weight matmul is slower than fp32: fp32. On a GPU: bf16.
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
