#!/usr/bin/env bash
# One entry point for a fresh machine.
#   ./run.sh serve [args]   set up, then start the service: tritonserver + the gateway on http://localhost:8080,
#                           with ports 8003 and 50000 for the official clients (--no-official-ports: without)
#                           (a tiny random model unless --model-dir is given)
#   ./run.sh test  [args]   set up, then run the test suite (args go to pytest)
#   ./run.sh setup          only set up: system packages and the virtualenv in .venv
set -euo pipefail
cd "$(dirname "$0")"
VENV=${COSYVOICE_VENV:-.venv}

setup() {
  bash scripts/setup.sh "$VENV"
}

case "${1:-}" in
  setup) setup ;;
  serve) shift; setup; exec "$VENV/bin/cosyvoice-triton" up "$@" ;;
  synth) shift; setup; exec "$VENV/bin/cosyvoice-triton" synth "$@" ;;
  test)  shift; setup; COSYVOICE_STRICT_TESTS=${COSYVOICE_STRICT_TESTS:-1} exec "$VENV/bin/python" -m pytest -n "${COSYVOICE_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@" ;;
  *) echo "usage: ./run.sh {setup|serve|synth|test} [args]" >&2; exit 2 ;;
esac
