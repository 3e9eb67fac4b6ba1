"""`cosyvoice-triton serve`: the README's "run the service" command, end to end in a subprocess."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from cosyvoice_triton.server import free_port
from cosyvoice_triton.server.launcher import ServeOptions, render_run_repository
from cosyvoice_triton.server.templates import TemplateError, model_names
from triton_harness import tritonserver_or_skip

REPO_ROOT = Path(__file__).resolve().parents[1]


def _lines(proc: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_serve_makes_the_tiny_model_prints_the_endpoints_and_stops_on_ctrl_c(tmp_path):
    tritonserver_or_skip()
    home = tmp_path / "home"
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "cosyvoice_triton.cli", "serve", "--address", "127.0.0.1",
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--run-dir", str(tmp_path / "run"), "--torch-threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            env={**os.environ, "COSYVOICE_HOME": str(home)})
    output: list[str] = []
    try:
        lines = _lines(proc)
        deadline = time.monotonic() + 300
        while not any("Press Ctrl-C" in line for line in output):
            line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
            assert line is not None, "serve exited early:\n" + "".join(output)
            output.append(line)
        text = "".join(output)
        assert f"http://127.0.0.1:{http}" in text and f"127.0.0.1:{grpc}" in text
        assert f"http://127.0.0.1:{metrics}/metrics" in text
        assert _ready(f"127.0.0.1:{http}")
        assert (home / "models" / "tiny" / "llm.pt").is_file()  # made on first use
        assert "cosyvoice2_offline" in model_names(tmp_path / "run" / "repo")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        rest = []
        while (line := lines.get(timeout=10)) is not None:
            rest.append(line)
        assert "tritonserver stopped (exit code 0)" in "".join(rest)
        assert not _ready(f"127.0.0.1:{http}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_render_run_repository_refuses_a_template_with_an_unknown_key(tmp_path):
    src = tmp_path / "templates"
    (src / "llm" / "1").mkdir(parents=True)
    (src / "llm" / "config.pbtxt").write_text('name: "llm"\nparameters { key: "x" value: { string_value: "${nope}" } }\n')
    with pytest.raises(TemplateError, match="llm/config.pbtxt: no value for nope"):
        render_run_repository(ServeOptions(repository=src), tmp_path / "m", "store.sqlite", tmp_path / "out")
    assert not (tmp_path / "out" / "llm").exists()
