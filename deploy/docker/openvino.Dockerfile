# syntax=docker/dockerfile:1
# CosyVoice2 on Triton for x86 CPUs without CUDA: token2wav's flow and HiFT decode and CAM++ on the
# OpenVINO runtime (`--engine openvino`), the LLM on torch's CPU build. Build from the repository root:
#
#   docker build -f deploy/docker/openvino.Dockerfile -t cosyvoice-triton:0.1.0-openvino .
#   docker run --shm-size=1g -p 8080:8080 -p 8003:8003 -p 50000:50000 -v cosyvoice-home:/var/lib/cosyvoice \
#       cosyvoice-triton:0.1.0-openvino
#
# The base is the same tritonserver 2.51 image as ./Dockerfile (its server and python_backend run on a
# machine without a GPU). For ONNX Runtime's OpenVINO execution provider instead, install the
# onnxruntime-openvino wheel in place of onnxruntime (they are one module) and run
# `up --engine onnxruntime --ort-providers openvino:device_type=CPU`. An Intel GPU or NPU needs its
# drivers in the image; only the CPU is tested (README, "Hardware").
FROM nvcr.io/nvidia/tritonserver:24.10-py3

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG OPENVINO_VERSION=2026.4.1

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    COSYVOICE_HOME=/var/lib/cosyvoice \
    TRITONSERVER=/opt/tritonserver/bin/tritonserver

WORKDIR /opt/cosyvoice-triton

COPY deploy/docker/constraints.txt deploy/docker/constraints.txt
RUN python3 -m pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && python3 -m pip install -c deploy/docker/constraints.txt "openvino==${OPENVINO_VERSION}" \
        "numpy" "onnx" "onnxruntime" "tokenizers" "safetensors" "pyyaml" "soundfile" "scipy" \
        "wetext" "tritonclient[all]" "aiohttp" "websockets" "redis" "prometheus-client"

COPY . .
# serve: the server's packages (a plain install is the client SDK alone)
RUN python3 -m pip install -c deploy/docker/constraints.txt -e ".[serve,openvino]" \
 && mkdir -p "${COSYVOICE_HOME}" \
 && cosyvoice-triton --help > /dev/null

VOLUME ["/var/lib/cosyvoice"]
# 8003 and 50000: the gateway's ports for the official Triton and gRPC clients (`up`'s defaults)
EXPOSE 8000 8001 8002 8003 8080 50000

ENTRYPOINT ["cosyvoice-triton"]
CMD ["up", "--port", "8080", "--device", "cpu", "--engine", "openvino", "--triton-address", "0.0.0.0"]
