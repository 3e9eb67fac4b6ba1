#!/usr/bin/env bash
# perf_analyzer concurrency sweep of the decoupled `cosyvoice2` model over streaming gRPC.
#
#   perf/perf_analyzer_sweep.sh [HOST:PORT] [INPUT_JSON] [-- extra perf_analyzer flags]
#
# HOST:PORT defaults to localhost:8001 (Triton gRPC), INPUT_JSON to perf/inputs/cosyvoice2_zero_shot.json
# (prompts inline, so no voice needs registering). Concurrency 1..4 step 2 (override with
# CONCURRENCY=1:16:2). Server-side metrics are collected from METRICS_URL (default http://HOST:8002/metrics);
# results go to perf/results/perf_analyzer-<time>.csv. perf_analyzer comes from `./run.sh setup`
# (build/perf_analyzer/); PERF_ANALYZER overrides its path.
set -euo pipefail

cd "$(dirname "$0")/.."
ADDR="${1:-localhost:8001}"
INPUT="${2:-perf/inputs/cosyvoice2_zero_shot.json}"
shift $(( $# > 2 ? 2 : $# ))
[[ "${1:-}" == "--" ]] && shift
PA="${PERF_ANALYZER:-build/perf_analyzer/bin/perf_analyzer}"
CONCURRENCY="${CONCURRENCY:-1:4:2}"
METRICS_URL="${METRICS_URL:-http://${ADDR%:*}:8002/metrics}"
OUT_DIR="perf/results"
mkdir -p "$OUT_DIR"
CSV="$OUT_DIR/perf_analyzer-$(date +%Y%m%d-%H%M%S).csv"

if [[ ! -x "$PA" ]]; then
    echo "perf_analyzer not found at $PA (run ./run.sh setup, or set PERF_ANALYZER)" >&2
    exit 1
fi

set -x
"$PA" -m cosyvoice2 -i grpc --streaming -u "$ADDR" \
    --input-data "$INPUT" \
    --concurrency-range "$CONCURRENCY" \
    --measurement-mode count_windows --measurement-request-count 8 \
    --collect-metrics --metrics-url "$METRICS_URL" --metrics-interval 1000 \
    --verbose-csv -f "$CSV" "$@"
set +x
echo "results: $CSV"
