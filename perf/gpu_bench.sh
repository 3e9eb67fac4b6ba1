#!/usr/bin/env bash
# GPU benchmark of the in-process serving path (perf/gpu_bench.py), for CosyVoice2 and CosyVoice3 (--family),
# each on a full-size random folder of its own: the LLM scheduler, the token2wav scheduler and the pipeline
# of the streaming model in one process, no tritonserver, N client threads per concurrency level. Per level:
# first / second chunk and total latency percentiles, RTF, throughput, errors; the report marks its targets
# met / not met (perf/gpu_report.py, TARGETS). After each family's levels (perf/gpu_stages.py): where one
# stream's time goes on the GPU (LLM prefill and decode steps, flow and HiFT calls) and, given
# --official-src CHECKOUT --official-venv VENV (a virtualenv with CUDA torch and the official code's
# packages), bench-official's rows against the official code on the GPU.
#
# On a machine with an NVIDIA GPU, from the repository root:
#   bash perf/gpu_bench.sh [options of perf/gpu_bench.py]     e.g. --scenario fast_clone long_text
# The report (report.md, results.json, one PNG per scenario) goes to the folder given by --out, default
# $COSYVOICE_PERF_RESULTS/gpu-<time>/ ($COSYVOICE_PERF_RESULTS defaults to perf/results/ of the checkout),
# and report.md to stdout at the end. It installs nothing from a registry (perf/gpu_env.sh):
#   - The Python that runs it (`python3`, or $PYTHON) must hold torch (with CUDA), onnx, onnxruntime,
#     numpy, pyyaml, scipy, safetensors and tokenizers; matplotlib for the plots. Without wetext the text is
#     not normalized; soundfile is not needed (prompts are passed as samples). The report says which is
#     missing.
#   - tensorrt (for --engine tensorrt) and onnxruntime-gpu (--engine onnxruntime on CUDA) must be installed
#     or be put as wheels in `wheels/` (see perf/gpu_env.sh); without them the token2wav engine falls back to
#     torch with one line.
#   - This project is installed from the checkout (editable, --no-index) when it is not importable.
# Time, per family: writing the full-size random folder takes about a minute, then two warm-up requests and
# the levels 1 4 16 64, for each variant: CUDA graphs off / on x LLM fp32 / bf16 (the served LLMScheduler and
# Token2WavScheduler, built as the Triton models build them); --time-budget-s (default 480 per family, shared
# out between its variants) keeps levels that would not fit from starting; the stage profile and the side
# by side come after, outside the budget.
set -euo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_env.sh
exec "$PYTHON" -m cosyvoice_triton.perf.gpu_bench "$@"
