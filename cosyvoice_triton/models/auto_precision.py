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
- Flow estimator, judged by what a listener hears (perf/quality.py, docs/benchmarks/quality.md: the flow's
  mel and the vocoder's f0 against fp32, offline and streamed; the waveform SNR, which a vocoder's phase
  drift ruins for any change, is no gate). bf16 and int8-dynamic (the transformer blocks' Linear layers in
  int8, each row on its own) stay within every bound on both families. On CPUs with AVX512-BF16 / AMX and on
  GPUs bf16 is native: bf16. On other CPUs with AVX512-VNNI (int8 dot products in one instruction)
  int8-dynamic is 1.5x faster per flow solve than fp32: int8-dynamic. With AVX2 only, int8-dynamic gains
  about 1.1x, within the noise of a shared machine, and bf16 is emulated: fp32. The statically quantized
  estimator graph (perf/flow_int8_static.py, ONNX Runtime) misses the mel SNR bound (30 dB) and re-runs every
  frame of a stream at each chunk (a graph takes no flow cache): not offered.
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
    """The CPU kind that decides `auto`: e.g. "AVX512 with BF16", "AVX512 without BF16, with VNNI" or
    "AVX2 without BF16"."""
    if cpu_has_bf16():
        return f"{_capability()} with BF16"
    return f"{_capability()} without BF16" + (", with VNNI" if cpu_has_vnni() else "")


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


def cpu_has_vnni() -> bool:
    """AVX512-VNNI (int8 dot products in one instruction) with ATen's kernels allowed AVX512 and the x86
    quantized engine present: where fbgemm's int8 kernels beat fp32 by more than the quantization costs."""
    vnni = getattr(torch.cpu, "_is_vnni_supported", lambda: False)()
    return vnni and _capability().startswith("AVX512") and _has_x86_int8_kernels()


def auto_flow_precision(device: str | torch.device = "cpu") -> str:
    """bf16 on GPUs and on CPUs with AVX512-BF16 / AMX, int8-dynamic on other CPUs with AVX512-VNNI, fp32
    elsewhere (module docstring)."""
    if _on_gpu(device) or cpu_has_bf16():
        return "bf16"
    return "int8-dynamic" if cpu_has_vnni() else "fp32"


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
