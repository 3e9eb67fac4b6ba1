"""`cosyvoice-triton serve` alone (without `up`) does not restart a tritonserver that dies: it exits 1 at
once, saying how the server ended and that `up` restarts it, instead of serving nothing while it runs on."""
from __future__ import annotations

import os
import sys

import psutil
import pytest

from cosyvoice_triton.server import free_port
from cli_harness import CliProcess
from polling import wait_until
from triton_harness import tritonserver_or_skip

pytestmark = pytest.mark.timeout(300)


def test_serve_exits_1_naming_the_kill_when_its_tritonserver_dies(tiny_model_dir, tmp_path):
    tritonserver_or_skip()
    command = [sys.executable, "-m", "cosyvoice_triton.cli", "serve", "--model-dir", str(tiny_model_dir),
               "--role", "backend", "--run-dir", str(tmp_path / "run"), "--http-port", str(free_port()),
               "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--torch-threads", "1"]  # the backend role: one model loads, sooner
    serve = CliProcess(command, {**os.environ, "COSYVOICE_HOME": str(tmp_path / "home")})
    try:
        wait_until(lambda: "Press Ctrl-C" in serve.output() or not serve.running(), timeout_s=240)
        assert serve.running(), serve.output()
        tritonservers = [p for p in psutil.Process(serve.process.pid).children(recursive=True)
                         if p.name() == "tritonserver"]
        assert len(tritonservers) == 1, tritonservers
        tritonservers[0].kill()
        assert serve.process.wait(timeout=60) == 1, serve.output()
        output = serve.output()
        assert "tritonserver exited on its own (killed by SIGKILL): serve stops with exit code 1" in output, output
        assert "`cosyvoice-triton up` restarts it instead" in output and "Traceback" not in output
    finally:
        serve.kill()
