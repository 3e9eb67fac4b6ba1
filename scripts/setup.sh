#!/usr/bin/env bash
# Install everything the project needs into a virtualenv (default .venv). Idempotent: a second run
# only checks. System packages come from Debian; Python packages from PyPI (`serve`: the server's packages
# on top of the client SDK's; torch's CPU build is
# pinned by the `cpu` extra because an unpinned torch pulls a multi-GB CUDA build; `openvino` runs the
# OpenVINO engine's tests; `bench` draws the benchmark plots and `docs` builds the docs site, both tested).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
STAMP="$VENV/.setup-stamp"
WANT=$(cat pyproject.toml scripts/setup.sh perf/install_perf_analyzer.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

# soundfile ships libsndfile in its wheel; redis-server backs the shared voice store and its tests;
# libb64-0d is needed by perf_analyzer; chromium runs the web-page test headless; espeak-ng speaks the
# benchmark prompts.
APT_PACKAGES="redis-server libb64-0d chromium espeak-ng"
missing=""
for p in $APT_PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
  else
    echo "note: missing system packages:$missing (install them with apt-get)" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[serve,cpu,test,server,openvino,train,bench,docs]"
# perf_analyzer (tritonclient 2.41.0's binary and libcudart) goes into build/, not into the venv.
bash perf/install_perf_analyzer.sh --python "$VENV/bin/python" >/dev/null
echo "$WANT" > "$STAMP"
