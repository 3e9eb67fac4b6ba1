#!/usr/bin/env bash
# Install perf_analyzer next to (not into) a Python environment, and print the path of a wrapper that
# runs it with the libraries it needs.
#
#   perf/install_perf_analyzer.sh [--dest DIR] [--python PY] [--no-apt]
#
# perf_analyzer ships as a binary inside the tritonclient 2.41.0 manylinux wheel (later wheels dropped
# it). That wheel is unpacked into DEST, so the environment's own tritonclient is never downgraded.
# The binary links two libraries that the wheel does not carry:
#   libb64.so.0d     Debian/Ubuntu package libb64-0d (apt-get; root needed)
#   libcudart.so.12  the nvidia-cuda-runtime-cu12 wheel, installed with --target into DEST/cuda
# When apt or the wheel cannot be had, the copies vendored in the nvidia-pytriton wheel
# (nvidia_pytriton.libs/libb64-*.so.0d, libcudart-*.so.12*) are linked in instead.
# No GPU is needed to run it. Idempotent: what is already there is kept.
#
# Defaults: DEST = <repo>/build/perf_analyzer, PY = the active virtualenv's python, else python3.
# The last line on stdout is the wrapper's path; progress goes to stderr.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$REPO_ROOT/build/perf_analyzer"
PY="${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}"
PY="${PY:-python3}"
USE_APT=1
TRITONCLIENT_VERSION=2.41.0

while [ $# -gt 0 ]; do
    case "$1" in
        --dest) DEST="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --no-apt) USE_APT=0; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

say() { echo "[install_perf_analyzer] $*" >&2; }

mkdir -p "$DEST/bin" "$DEST/lib" "$DEST/wheels"
DEST="$(cd "$DEST" && pwd)"

# The folder of nvidia-pytriton's vendored libraries, if that wheel is installed in PY's environment.
PYTRITON_LIBS="$("$PY" - <<'EOF' 2>/dev/null || true
import importlib.util, pathlib
spec = importlib.util.find_spec("pytriton")
if spec and spec.submodule_search_locations:
    libs = pathlib.Path(list(spec.submodule_search_locations)[0]).parent / "nvidia_pytriton.libs"
    if libs.is_dir():
        print(libs)
EOF
)"

have_system_lib() { ldconfig -p 2>/dev/null | grep -q "$1"; }

link_vendored() {  # link_vendored GLOB NAME: DEST/lib/NAME -> a pytriton-vendored library
    local found
    [ -n "$PYTRITON_LIBS" ] || return 1
    found="$(ls "$PYTRITON_LIBS"/$1 2>/dev/null | head -n 1)"
    [ -n "$found" ] || return 1
    ln -sfn "$found" "$DEST/lib/$2"
    say "linked $2 -> $found"
}

# 1. libb64.so.0d
if have_system_lib libb64.so.0d || [ -e "$DEST/lib/libb64.so.0d" ]; then
    say "libb64.so.0d: present"
elif [ "$USE_APT" = 1 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] \
        && { DEBIAN_FRONTEND=noninteractive apt-get install -y -q libb64-0d >&2 \
             || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libb64-0d >&2; }; }; then
    say "libb64.so.0d: installed libb64-0d with apt-get"
elif link_vendored 'libb64-*.so.0d' libb64.so.0d; then
    :
else
    say "libb64.so.0d: not found; install the libb64-0d package (apt-get install libb64-0d)"
    exit 1
fi

# 2. perf_analyzer from the tritonclient 2.41.0 wheel
case "$(uname -m)" in
    x86_64) PLATFORMS=(--platform manylinux1_x86_64 --platform manylinux2014_x86_64) ;;
    aarch64) PLATFORMS=(--platform manylinux2014_aarch64) ;;
    *) say "unsupported machine $(uname -m)"; exit 1 ;;
esac
if [ ! -x "$DEST/bin/perf_analyzer.bin" ]; then
    if ! ls "$DEST"/wheels/tritonclient-"$TRITONCLIENT_VERSION"-*.whl >/dev/null 2>&1; then
        say "downloading tritonclient==$TRITONCLIENT_VERSION"
        "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" \
            "tritonclient==$TRITONCLIENT_VERSION" -d "$DEST/wheels" >&2
    fi
    WHEEL="$(ls "$DEST"/wheels/tritonclient-"$TRITONCLIENT_VERSION"-*.whl | head -n 1)"
    "$PY" - "$WHEEL" "$DEST/bin/perf_analyzer.bin" <<'EOF'
import os, shutil, sys, zipfile
wheel, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    name = next(n for n in zf.namelist() if n.endswith("/bin/perf_analyzer"))
    with zf.open(name) as src, open(target + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
os.chmod(target + ".part", 0o755)
os.replace(target + ".part", target)
EOF
    say "perf_analyzer: unpacked from $(basename "$WHEEL")"
    rm -f "$WHEEL"
fi

# 3. libcudart.so.12
CUDART_DIR=""
if have_system_lib libcudart.so.12; then
    say "libcudart.so.12: present in the system"
else
    if [ ! -e "$DEST/cuda/nvidia/cuda_runtime/lib/libcudart.so.12" ] && [ ! -e "$DEST/lib/libcudart.so.12" ]; then
        say "installing nvidia-cuda-runtime-cu12 into $DEST/cuda"
        "$PY" -m pip install -q --no-deps --target "$DEST/cuda" "nvidia-cuda-runtime-cu12>=12,<13" >&2 \
            || link_vendored 'libcudart-*.so.12*' libcudart.so.12 \
            || { say "libcudart.so.12: not found; pip install nvidia-cuda-runtime-cu12"; exit 1; }
    fi
    if [ -e "$DEST/cuda/nvidia/cuda_runtime/lib/libcudart.so.12" ]; then
        CUDART_DIR="$DEST/cuda/nvidia/cuda_runtime/lib"
    fi
fi

# 4. the wrapper
WRAPPER="$DEST/bin/perf_analyzer"
cat > "$WRAPPER.part" <<EOF
#!/bin/sh
# perf_analyzer $TRITONCLIENT_VERSION with its libraries; written by perf/install_perf_analyzer.sh
LD_LIBRARY_PATH="$DEST/lib${CUDART_DIR:+:$CUDART_DIR}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "$DEST/bin/perf_analyzer.bin" "\$@"
EOF
chmod +x "$WRAPPER.part"
mv "$WRAPPER.part" "$WRAPPER"

if ! "$WRAPPER" --version >&2; then
    say "the wrapper does not run; missing libraries:"
    LD_LIBRARY_PATH="$DEST/lib${CUDART_DIR:+:$CUDART_DIR}" ldd "$DEST/bin/perf_analyzer.bin" | grep "not found" >&2 || true
    exit 1
fi
echo "$WRAPPER"
