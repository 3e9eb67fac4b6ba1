# Sourced by perf/gpu_check.sh and perf/gpu_bench.sh: the Python that runs a GPU script ($PYTHON, default
# python3), installing nothing from a registry. Wheels put in wheels/ at the repository root (for packages the
# machine lacks, e.g. tensorrt or onnxruntime-gpu) are installed with `pip --no-index --no-deps` into
# build/gpu-site/, ahead of the installed packages; this project is installed from the checkout (editable)
# when it is not importable.
PYTHON=${PYTHON:-python3}
if compgen -G "wheels/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target build/gpu-site wheels/*.whl
    export PYTHONPATH=$PWD/build/gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PYTHON" -c "import cosyvoice_triton.perf" 2> /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
export PYTHONUNBUFFERED=1
