"""The plain gateway (`python -m cosyvoice_triton.gateway`, as a Kubernetes pod runs it) drains on SIGTERM
as `cosyvoice-triton up` does (gateway/drain.py): a stream in flight finishes whole, a new request during
the drain gets 503 with Retry-After (and /readyz says "draining"), and the process exits 0.

The gateway runs as a real subprocess in front of the session's shared tiny tritonserver
(tests/web/stack.py). So that the stream is surely still running while the test looks at the drain,
tritonserver is paused (SIGSTOP) once the stream's first chunk has arrived and resumed (SIGCONT) after
the drain was seen; the stream then runs to its end.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from cli_harness import CliProcess
from cosyvoice_triton.client import GatewayTTS, TritonTTS, TTSError
from cosyvoice_triton.server.process import free_port
from polling import wait_until
from web.stack import triton_server, wait_ready

pytestmark = pytest.mark.timeout(300)

# A few sentences: the stream runs on for a while after its first chunk (the random LLM may stop early in any one)
TEXT = "The gateway drains this stream. It keeps going for a while. Then it ends as a whole. And one more."
SEED = 21
ATOL = 2e-4  # equal up to float rounding (tests/test_client_sdk.py)


@pytest.fixture(scope="module")
def triton(tmp_path_factory, tiny_model_dir):
    with triton_server(tmp_path_factory.mktemp("gateway_drain"), tiny_model_dir) as (server, model_dir, voice_store):
        yield server, model_dir, voice_store


def readyz(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_plain_gateway_drains_on_sigterm_and_exits_0(triton, tmp_path):
    server, model_dir, voice_store = triton
    port, target = free_port(), server.target
    command = [sys.executable, "-m", "cosyvoice_triton.gateway", "--triton",
               f"grpc://{target.grpc}?metrics={target.metrics_url}", "--voice-store", voice_store,
               "--model-dir", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--drain-timeout", "120"]
    gateway = CliProcess(command, {**os.environ, "COSYVOICE_HOME": str(tmp_path)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        stream = GatewayTTS(url).stream(TEXT, seed=SEED)
        chunks = [next(stream)]  # the stream is running
        os.kill(server.pid, signal.SIGSTOP)  # and stays so until SIGCONT
        try:
            gateway.process.send_signal(signal.SIGTERM)
            wait_until(lambda: readyz(url)[1].get("status") == "draining", timeout_s=60)
            ready_status, ready_body = readyz(url)
            with pytest.raises(TTSError) as refused:
                GatewayTTS(url).synthesize("Yes.", seed=1)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        chunks.extend(stream)
        exit_code = gateway.process.wait(timeout=180)
    finally:
        gateway.kill()
    output = gateway.output()
    assert exit_code == 0, output
    assert ready_status == 503 and ready_body["draining"] == "the server is shutting down", ready_body
    assert re.search(r"draining: [1-9]\d* request\(s\) in flight", output) and "\ndrained\n" in output, output
    assert (refused.value.status, refused.value.code, refused.value.retry_after_s) == (503, "unavailable", 1.0)
    assert "the server is shutting down" in refused.value.message
    with TritonTTS(server.grpc_url) as direct:
        alone = direct.synthesize(TEXT, voice_id="default", seed=SEED)
    audio = np.concatenate(chunks)
    assert audio.shape == alone.shape and float(np.abs(audio - alone).max()) <= ATOL  # it finished whole
