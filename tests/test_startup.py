"""What `up` and `serve` say before they serve: a taken port or a folder that is not a model folder is an
error naming the cause, at once, before any tritonserver starts."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cosyvoice_triton.server import free_port
from triton_harness import tritonserver_or_skip

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def listener():
    """Another process listening on a port (as a first `./run.sh serve` would): (port, pid)."""
    port = free_port()
    code = ("import socket, sys, time\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('0.0.0.0', {port})); s.listen(); print('listening', flush=True); time.sleep(600)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "listening"
    yield port, process.pid
    process.kill()
    process.wait()


def run_cli(args: list[str], home, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COSYVOICE_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "cosyvoice_triton.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def _no_tritonserver_started(home) -> bool:
    return not list((home / "runs").glob("*/tritonserver.log")) if (home / "runs").exists() else True


def test_a_second_up_names_the_taken_gateway_port_and_its_process(listener, tiny_model_dir, tmp_path):
    port, pid = listener
    result = run_cli(["up", "--model-dir", str(tiny_model_dir), "--port", str(port)], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"the gateway's port (--port) 0.0.0.0:{port} is in use by python" in result.stderr
    assert f"(pid {pid})" in result.stderr and "Traceback" not in result.stderr
    assert "ready" not in result.stdout and "starting tritonserver" not in result.stdout
    assert _no_tritonserver_started(tmp_path)


def test_up_names_a_taken_triton_port(listener, tiny_model_dir, tmp_path):
    port, pid = listener
    result = run_cli(["up", "--model-dir", str(tiny_model_dir), "--port", str(free_port()),
                      "--triton-grpc-port", str(port), "--triton-http-port", "0", "--triton-metrics-port", "0"],
                     tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"tritonserver's gRPC port (--triton-grpc-port) 127.0.0.1:{port} is in use by python (pid {pid})" \
        in result.stderr
    assert _no_tritonserver_started(tmp_path)


def test_serve_names_a_taken_port_before_tritonserver_starts(listener, tiny_model_dir, tmp_path):
    tritonserver_or_skip()
    port, pid = listener
    result = run_cli(["serve", "--model-dir", str(tiny_model_dir), "--http-port", str(port),
                      "--grpc-port", "0", "--metrics-port", "0"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"tritonserver's HTTP port 127.0.0.1:{port} is in use by python (pid {pid})" in result.stderr
    assert "Traceback" not in result.stderr
    assert _no_tritonserver_started(tmp_path)


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_folder_that_is_not_a_model_folder_is_refused_at_once(command, tiny_model_dir, tmp_path):
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    (folder / "llm.pt").write_bytes((tiny_model_dir / "llm.pt").read_bytes())
    started = time.monotonic()
    ports = ["--port", str(free_port())] if command == "up" else []
    result = run_cli([command, "--model-dir", str(folder), *ports], tmp_path / "home")
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr
    assert f"{folder} is not a CosyVoice2 model folder" in message, message
    for missing in ("cosyvoice2.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx",
                    "CosyVoice-BlankEN/config.json"):
        assert missing in message
    assert "llm.pt" not in message.split("missing")[1]  # present, so not named
    assert "Traceback" not in message and _no_tritonserver_started(tmp_path / "home")
    print(f"{command}: refused in {time.monotonic() - started:.1f} s")
