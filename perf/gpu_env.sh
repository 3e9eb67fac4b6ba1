# Sourced by perf/gpu_check.sh and perf/gpu_bench.sh: the Python that runs a GPU script, installing nothing
# from a registry. Wheels in wheels/ (carried to the device machine) go into /tmp/cosyvoice_gpu_site ahead
# of the image's packages; this project is installed from the working tree when it is not importable.
PYTHON=${PYTHON:-python3}
if compgen -G "wheels/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/cosyvoice_gpu_site wheels/*.whl
    export PYTHONPATH=/tmp/cosyvoice_gpu_site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PYTHON" -c "import cosyvoice_triton.perf" 2> /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
export PYTHONUNBUFFERED=1
