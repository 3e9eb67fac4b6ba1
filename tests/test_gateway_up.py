"""`cosyvoice-triton up` as a user runs it: tritonserver and the gateway from one command, on a fresh home, with
the official clients' ports open by default (Triton's gRPC protocol on 8003, the official gRPC API on 50000).
Every other test that starts `up` passes --no-official-ports (or ports of its own), so that only this one
holds those two."""
from __future__ import annotations

import io
import json
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.request

import pytest
import soundfile as sf

from cosyvoice_triton.server import free_port
from cli_harness import CliProcess
from test_gateway import shipped_default_voice
from test_official_api import grpc_request, official_grpc
from test_official_facade import infer, stream
from test_official_triton import official_inputs
from triton_harness import tritonserver_or_skip

pytestmark = pytest.mark.timeout(300)


def _request(url: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


def test_up_starts_triton_and_the_gateway_with_a_default_voice_and_the_official_ports(tiny_model_dir, tmp_path):
    """Ports of the gateway and of tritonserver chosen free here; the official ones are up's defaults."""
    tritonserver_or_skip()
    home = tmp_path / "home"
    port = free_port()
    command = [sys.executable, "-m", "cosyvoice_triton.cli", "up", "--model-dir", str(tiny_model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--triton-http-port", "0", "--triton-grpc-port", "0",
               "--triton-metrics-port", "0", "--workers", "4", "--torch-threads", "1", "--max-token-text-ratio", "3"]
    env = {**os.environ, "COSYVOICE_HOME": str(home)}
    up = CliProcess(command, env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        status = 0
        while status != 200:
            assert up.running(), up.output()
            assert time.monotonic() < deadline, "not ready in time:\n" + up.output()
            time.sleep(0.5)
            status, body = _request(url + "/readyz", timeout_s=5)
        assert json.loads(body)["default_voice"] == "ready"

        status, body = _request(url + "/v1/tts", {"text": "A fresh install speaks.", "voice": "default", "seed": 1})
        assert status == 200, body[:300]
        audio, rate = sf.read(io.BytesIO(body))
        assert rate == 24000 and audio.size > 0
        status, body = _request(url + "/v1/voices")
        voices = json.loads(body)["voices"]
        assert status == 200 and [v["id"] for v in voices] == ["default"] and shipped_default_voice(voices[0])
        assert (home / "voices.sqlite").exists()

        # The official clients, unchanged, on the documented ports: runtime/python/grpc/client.py (sft: a
        # registered voice) and runtime/triton_trtllm/client_grpc.py (its spk2info form: voice "default").
        assert "official Triton gRPC 127.0.0.1:8003" in up.output() and "official gRPC 127.0.0.1:50000" in up.output()
        chunks = official_grpc(50000, grpc_request("sft_request", spk_id="default", tts_text="Official gRPC."))
        assert chunks and sum(len(c) for c in chunks) > 0
        streamed = stream("127.0.0.1:8003", "cosyvoice2", official_inputs("Official Triton, streamed."))
        assert streamed and all(chunk.size > 0 for chunk in streamed)
        offline = infer("127.0.0.1:8003", "cosyvoice2", official_inputs("Official Triton, offline."))
        assert offline.as_numpy("waveform").size > 0

        assert up.interrupt(timeout_s=60) == 0
    finally:
        up.kill()
    output = up.output()
    assert "gateway  http://127.0.0.1:" in output and "tritonserver stopped (exit code" in output, output
    grpc_port = int(re.search(r"triton   grpc 127\.0\.0\.1:(\d+)", output).group(1))
    for port_in_use in (grpc_port, port):  # both servers are gone
        with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
            sock.connect(("127.0.0.1", port_in_use))


def test_a_server_that_exits_non_zero_on_stop_has_its_log_end_printed(tmp_path):
    """`up` names the server that did not stop cleanly and prints the end of its log, where tritonserver
    says why; servers that stopped with 0 (or had died before) print nothing."""
    from cosyvoice_triton.gateway.up import exit_code, print_failed_stops
    from cosyvoice_triton.server.process import TritonProcess

    logs = {}
    for name, text in {"frontend-0": "loaded\n" * 20 + "failed to stop server: Exit timeout expired\n",
                       "backend-0": "clean\n"}.items():
        workdir = tmp_path / name
        workdir.mkdir()
        (workdir / "tritonserver.log").write_text(text)
        logs[name] = TritonProcess(tmp_path, workdir=workdir)  # never started: only its log is read
    out = io.StringIO()
    codes = {"frontend-0": 1, "backend-0": 0, "frontend-1": None}
    print_failed_stops(logs, codes, out)
    printed = out.getvalue()
    assert printed.startswith(f"frontend-0 exited 1; the end of its log ({logs['frontend-0'].log_path}):")
    assert printed.rstrip().endswith("failed to stop server: Exit timeout expired")
    assert printed.count("loaded") == 11 and "backend-0" not in printed and "clean" not in printed
    assert exit_code(codes) == 1 and exit_code({"frontend-0": 0, "backend-0": None}) == 0
