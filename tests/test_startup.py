"""What `up` and `serve` say before they serve: a taken port or a folder that is not a model folder is an
error naming the cause, at once, before any tritonserver starts."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from cosyvoice_triton.server import free_port
from cli_harness import CliProcess
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
    result = run_cli(["up", "--model-dir", str(tiny_model_dir), "--port", str(port), "--no-official-ports"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"the gateway's port (--port) 0.0.0.0:{port} is in use by python" in result.stderr
    assert f"(pid {pid})" in result.stderr and "Traceback" not in result.stderr
    assert "ready" not in result.stdout and "starting tritonserver" not in result.stdout
    assert _no_tritonserver_started(tmp_path)


def test_up_names_a_taken_triton_port(listener, tiny_model_dir, tmp_path):
    port, pid = listener
    result = run_cli(["up", "--model-dir", str(tiny_model_dir), "--port", str(free_port()), "--no-official-ports",
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
    ports = ["--port", str(free_port()), "--no-official-ports"] if command == "up" else []
    result = run_cli([command, "--model-dir", str(folder), *ports], tmp_path / "home")
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr
    assert f"{folder} is not a CosyVoice2 or CosyVoice3 model folder" in message, message
    for missing in ("cosyvoice2.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx",
                    "CosyVoice-BlankEN/config.json"):
        assert missing in message
    assert "llm.pt" not in message.split("missing")[1]  # present, so not named
    assert "Traceback" not in message and _no_tritonserver_started(tmp_path / "home")
    print(f"{command}: refused in {time.monotonic() - started:.1f} s")


def _get(url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read() or b"{}")


def test_the_gateway_answers_while_tritonserver_starts_and_says_the_model_is_random(tiny_model_dir, tmp_path):
    """The port opens at once: 503 "starting" naming what it waits for (also on synthesis, with Retry-After),
    progress lines while the models load, then ready; a random folder is called noise in the banner and
    on /readyz."""
    tritonserver_or_skip()
    port = free_port()
    command = [sys.executable, "-m", "cosyvoice_triton.cli", "up", "--model-dir", str(tiny_model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--triton-http-port", "0", "--triton-grpc-port", "0",
               "--triton-metrics-port", "0", "--workers", "2", "--torch-threads", "1", "--max-token-text-ratio", "3",
               "--no-official-ports"]  # 8003 and 50000 are tests/test_gateway_up.py's
    up = CliProcess(command, {**os.environ, "COSYVOICE_HOME": str(tmp_path / "home")})
    url = f"http://127.0.0.1:{port}"
    answers = []
    try:
        deadline = time.monotonic() + 280
        while not answers or answers[-1][0] != 200:
            assert up.running(), up.output()
            assert time.monotonic() < deadline, "not ready in time:\n" + up.output()
            try:
                answers.append(_get(url + "/readyz"))
            except OSError as exc:  # refused before the gateway listens; a slow answer on a loaded machine
                refused = isinstance(getattr(exc, "reason", exc), ConnectionRefusedError)
                assert not (refused and answers), "the gateway stopped listening:\n" + up.output()
            if len(answers) == 1 and answers[0][0] == 503:
                status, headers, body = _get(url + "/v1/tts", {"text": "Too early.", "voice_id": "default"})
                assert status == 503 and headers.get("Retry-After"), (status, body)
            time.sleep(0.5)
        request = urllib.request.Request(url + "/v1/tts", data=json.dumps({"text": "Ready.", "voice_id": "default"})
                                         .encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:  # the started server stays up and serves
            assert response.status == 200 and response.read(4) == b"RIFF"
        assert up.interrupt(timeout_s=60) == 0
    finally:
        up.kill()
    first_status, _, first = answers[0]
    assert first_status == 503 and first["status"] == "starting", answers[0]
    assert any(w.startswith("tritonserver 127.0.0.1:") for w in first["waiting_for"]), first
    last = answers[-1][2]
    assert last["status"] == "ready" and last["waiting_for"] == [] and last["model"].startswith("random weights")
    output = up.output()
    assert "WARNING  random weights: it speaks noise; point --model-dir at the released folder" in output
    assert re.search(r"tritonserver ready after \d+ s", output), output


# ---- the default model (no --model-dir): stand-in hub packages and caches, no network ----------------------

@pytest.fixture
def bare_home(tmp_path, monkeypatch):
    """A home with no hub caches and no hub packages importable (stand-ins are added per test)."""
    home = tmp_path / "user"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("COSYVOICE_MODEL_DIR", "MODELSCOPE_CACHE", "HF_HOME", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    site = tmp_path / "stand_in_site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    saved = {name: sys.modules.pop(name, None) for name in ("modelscope", "huggingface_hub")}
    for name in saved:
        stand_in(site, name, "    raise ConnectionError('no network in this test')\n")
    yield home, site
    # The stand-ins must not outlive the test: a later test of this process imports the real package
    # (peft -> transformers -> huggingface_hub.utils).
    for name, module in saved.items():
        sys.modules.pop(name, None)
        if module is not None:
            sys.modules[name] = module


def stand_in(site, package: str, body: str) -> None:
    """A `package` whose snapshot_download(model_id, cache_dir=None) runs `body`."""
    (site / package).mkdir(exist_ok=True)
    (site / package / "__init__.py").write_text("calls = []\ndef snapshot_download(model_id, cache_dir=None):\n"
                                                "    calls.append(model_id)\n" + body)
    sys.modules.pop(package, None)


def released(folder):
    folder.mkdir(parents=True)
    (folder / "cosyvoice2.yaml").write_text("# stand-in\n")
    return folder


def test_the_default_model_is_the_one_cosyvoice_model_dir_names(bare_home, tmp_path, monkeypatch):
    from cosyvoice_triton.model_hub import default_model

    folder = released(tmp_path / "mine")
    released(bare_home[0] / ".cache" / "modelscope" / "hub" / "iic" / "CosyVoice2-0.5B")
    monkeypatch.setenv("COSYVOICE_MODEL_DIR", str(folder))
    choice = default_model()
    assert (choice.path, choice.source) == (folder.resolve(), "COSYVOICE_MODEL_DIR")


def test_the_default_model_comes_from_the_modelscope_cache_before_hugging_face(bare_home):
    from cosyvoice_triton.model_hub import default_model

    home, _ = bare_home
    snapshot = released(home / ".cache" / "huggingface" / "hub" / "models--FunAudioLLM--CosyVoice2-0.5B"
                        / "snapshots" / "0123abc")
    assert default_model().path == snapshot and default_model().source == "Hugging Face cache"
    modelscope = released(home / ".cache" / "modelscope" / "hub" / "iic" / "CosyVoice2-0.5B")
    assert (default_model().path, default_model().source) == (modelscope, "ModelScope cache")


def test_the_default_model_is_downloaded_when_a_hub_answers(bare_home, tmp_path):
    from cosyvoice_triton.model_hub import default_model

    _, site = bare_home
    downloaded = released(tmp_path / "downloaded")
    stand_in(site, "huggingface_hub", f"    return {str(downloaded)!r}\n")  # ModelScope fails, then this
    lines = []
    choice = default_model(log=lines.append)
    assert (choice.path, choice.source) == (downloaded, "downloaded")
    import huggingface_hub
    import modelscope

    assert modelscope.calls == ["iic/CosyVoice2-0.5B"] and huggingface_hub.calls == ["FunAudioLLM/CosyVoice2-0.5B"]
    assert any("modelscope could not download iic/CosyVoice2-0.5B: ConnectionError" in line for line in lines)


def test_without_any_released_model_the_default_is_the_random_folder_and_up_says_so(bare_home, tmp_path,
                                                                                    monkeypatch):
    import argparse

    from cosyvoice_triton.gateway.up import resolve_model_dir
    from cosyvoice_triton.model_hub import default_model
    from cosyvoice_triton.random_folder.marker import is_random

    assert default_model(log=lambda line: None).source == "random"
    out = io.StringIO()
    monkeypatch.setenv("COSYVOICE_HOME", str(tmp_path / "cvhome"))
    folder = resolve_model_dir(argparse.Namespace(model_dir=None), out)
    assert is_random(folder) and folder == tmp_path / "cvhome" / "models" / "tiny"
    assert "no released CosyVoice2-0.5B here" in out.getvalue()
