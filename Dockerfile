# syntax=docker/dockerfile:1
# CosyVoice2 on Triton: one image for every role (all-in-one `up`, `serve`, and the gateway).
#
#   docker build -t cosyvoice-triton:0.1.0 .
#   docker run --gpus all --shm-size=1g -p 8080:8080 -p 8003:8003 -p 50000:50000 \
#       -v cosyvoice-home:/var/lib/cosyvoice cosyvoice-triton:0.1.0
#
# --shm-size=1g (or --ipc=host) is required: every Python-backend model instance keeps a region in
# /dev/shm (16 MiB, grown on demand) and Docker's default /dev/shm is 64 MiB ("Failed to increase the
# shared memory pool size" otherwise). In Kubernetes mount an emptyDir {medium: Memory} on /dev/shm.
#
# The base matches tritonserver 2.51 (the version the launcher and tests are written against). Pin it
# by digest too when you publish: FROM nvcr.io/nvidia/tritonserver:24.10-py3@sha256:<digest>.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

# torch: the PyPI Linux wheel bundles its own CUDA runtime (print torch.version.cuda to see which);
# the host driver must support it. 2.13.0 is the version CI tests with (CPU build there). For an
# older driver choose a build that matches the container's CUDA 12.6, e.g.
#   --build-arg TORCH_VERSION=2.7.1 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    COSYVOICE_HOME=/var/lib/cosyvoice \
    TRITONSERVER=/opt/tritonserver/bin/tritonserver

WORKDIR /opt/cosyvoice-triton

# Dependencies first (own layer, cached while only the source changes). Installed into the system
# Python 3.10: the container's python_backend stub embeds 3.10 and imports from its site-packages.
COPY deploy/docker/constraints.txt deploy/docker/constraints.txt
RUN python3 -m pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && python3 -m pip install -c deploy/docker/constraints.txt \
        "numpy" "onnx" "onnxruntime-gpu" "tokenizers" "safetensors" "pyyaml" "soundfile" "scipy" \
        "wetext" "tritonclient[all]" "aiohttp" "websockets" "redis" "prometheus-client" "tensorrt"

COPY . .
# Editable, so the image runs the tree it was built from, as a checkout does. A plain install works too:
# the model_repository templates, gateway/static and the default voice are package data of the wheel
# (tests/test_packaging.py).
# serve: the server's packages (a plain install is the client SDK alone). onnxruntime (in serve) and
# onnxruntime-gpu install the same module; keep the GPU one.
RUN python3 -m pip install -c deploy/docker/constraints.txt -e ".[serve,gpu]" \
 && python3 -m pip uninstall -y onnxruntime \
 && python3 -m pip install --force-reinstall --no-deps -c deploy/docker/constraints.txt onnxruntime-gpu \
 && mkdir -p "${COSYVOICE_HOME}" \
 && cosyvoice-triton --help > /dev/null

VOLUME ["/var/lib/cosyvoice"]
# 8080 gateway (HTTP, WebSocket, /metrics): the port to publish, with 8003 and 50000, the gateway's ports for
# the official Triton clients and the official gRPC client (`up`'s defaults). 8000-8002 (Triton HTTP, gRPC,
# metrics) are used by `serve --address 0.0.0.0` containers of the split deployment, on a private network.
EXPOSE 8000 8001 8002 8003 8080 50000

ENTRYPOINT ["cosyvoice-triton"]
# `up` binds tritonserver to 127.0.0.1: Triton has no keys or limits, so clients reach it only through
# the gateway on 8080 (Triton's metrics: `docker exec ... curl -s 127.0.0.1:8002/metrics`).
CMD ["up", "--port", "8080", "--device", "cuda"]
