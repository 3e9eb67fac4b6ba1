#!/usr/bin/env bash
# GPU check of the token2wav and CAM++ engines on one GPU: parity of ONNX Runtime CUDA and TensorRT
# (fp16, fp32) with torch, and per-call times of the flow estimator (one Euler step and the 10-step
# loop), HiFT and CAM++ at 1, 4 and 16 streams for 1 s and 4 s chunks, for torch eager, torch with CUDA
# graphs, ONNX Runtime CUDA and TensorRT; one report per family (--family, default CosyVoice2 and CosyVoice3:
# the DiT estimator and the causal HiFT, which have no ONNX graphs, on the torch columns only).
# perf/gpu_check.py says what each number is.
#
# On a machine with an NVIDIA GPU, from the repository root:
#   bash perf/gpu_check.sh [options of perf/gpu_check.py]     e.g. --precisions fp16 --iters 10
# The markdown report (date, GPU, versions, engine status, parity table, timing table) goes to stdout
# and to the file given by --out, default $COSYVOICE_PERF_RESULTS/gpu-check-<time>.md
# ($COSYVOICE_PERF_RESULTS defaults to perf/results/ of the checkout). It installs nothing from a registry:
#   - The Python that runs it (`python3`, or $PYTHON) must hold torch with CUDA, onnx, numpy, pyyaml,
#     scipy and tokenizers.
#   - onnxruntime-gpu (the "ORT CUDA" column) and tensorrt (the "TRT" columns) must be installed, or be put
#     as wheels in a `wheels/` folder at the repository root (git ignores `*.whl`). Each wheel there is
#     installed (`pip --no-index --no-deps`) into build/gpu-site/, ahead of the installed packages (gpu_env.sh):
#     put each dependency that the machine lacks there too, one version of each. A column whose package is
#     missing is reported unavailable, with the reason, and the rest of the check runs.
#   - This project is installed from the checkout (editable, --no-index) when it is not importable.
# Time: writing the full-size folder and exporting ONNX take about a minute; the first run builds
# 2 x 4 TensorRT plans, which dominates (cached in the work folder for reruns on the same machine;
# --precisions fp16 halves it). --dry-run stops after the ONNX export; --device cpu --size tiny runs the
# whole check on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_env.sh
exec "$PYTHON" -m cosyvoice_triton.perf.gpu_check "$@"
