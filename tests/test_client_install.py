"""`pip install '.[client]'` is the SDK alone: the wheel with only the `client` extra, installed into a fresh
virtualenv (no system site packages), imports every module of `cosyvoice_triton.client` without any of the
server's packages (torch, ONNX, SciPy, tokenizers, wetext, Redis, psutil, ...), and streams audio from a running
service (the shared tiny stack of tests/web/stack.py: tritonserver and the gateway) through the gateway (HTTP
and WebSocket), through Triton's gRPC, and with `cosyvoice-client`. `cosyvoice-triton` is installed too: it
answers --version and names the `serve` extra for its commands."""
from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import cosyvoice_triton
from test_packaging import REPO_ROOT, fresh_env, import_name, new_venv, wheel  # noqa: F401 - wheel: the fixture
from web.stack import serve_stack

pytestmark = pytest.mark.timeout(900)

# Import names of the `serve` extra's packages (and the tools' ones): none may be in a client install.
SERVER_ONLY = ("torch", "onnx", "onnxruntime", "scipy", "tokenizers", "wetext", "redis", "psutil", "soundfile",
               "yaml", "safetensors", "prometheus_client", "matplotlib", "pytest")

# Runs in the client venv: which SERVER_ONLY packages import, which client modules fail (and on what), and the
# distribution's requirements.
PROBE = r"""
import importlib, importlib.metadata, json, pkgutil, sys
import cosyvoice_triton.client as client

present = []
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
        present.append(name)
    except ImportError:
        pass
failed = {}
for info in pkgutil.walk_packages(client.__path__, "cosyvoice_triton.client."):
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        failed[info.name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"present": present, "failed": failed, "root": client.__file__,
                  "requires": importlib.metadata.distribution("cosyvoice-triton").requires}))
"""

# Runs in the client venv against the stack: the chunks of one stream per path, as [count, samples].
STREAMS = r"""
import json, sys
from cosyvoice_triton.client import GatewayTTS, TritonTTS

gateway_url, triton_url = sys.argv[1:3]
seen = {}
with GatewayTTS(gateway_url, timeout_s=300) as tts:
    with tts.stream("A client install streams.", voice_id="default", seed=1) as chunks:
        sizes = [chunk.size for chunk in chunks]
    seen["gateway_http"] = [len(sizes), sum(sizes)]
    with tts.stream_ws(["A client install ", "streams over a WebSocket."], voice_id="default", seed=1) as chunks:
        sizes = [chunk.size for chunk in chunks]
    seen["gateway_ws"] = [len(sizes), sum(sizes)]
with TritonTTS(triton_url, timeout_s=300) as tts:
    with tts.stream("A client install streams from Triton.", voice_id="default", seed=1) as chunks:
        sizes = [chunk.size for chunk in chunks]
    seen["triton_grpc"] = [len(sizes), sum(sizes)]
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def client_venv(wheel, tmp_path_factory) -> Path:  # noqa: F811 - the imported fixture
    """The wheel with only its `client` extra."""
    return new_venv(tmp_path_factory.mktemp("client") / "venv", f"cosyvoice-triton[client] @ {wheel.as_uri()}",
                    timeout_s=600)


def run_in(venv: Path, *command: str, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / command[0]), *command[1:]], cwd=cwd, env=fresh_env(),
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def test_the_client_extra_installs_the_sdk_without_the_server(client_venv, tmp_path):
    probe = run_in(client_venv, "python", "-c", PROBE, json.dumps(SERVER_ONLY), cwd=tmp_path)
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-2000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(seen["root"]).resolve().is_relative_to(client_venv.resolve())
    assert seen["present"] == [], f"server packages in a client install: {seen['present']}"
    assert seen["failed"] == {}
    base = {import_name(str(r)) for r in map(Requirement, seen["requires"]) if r.marker is None}
    assert base == {"numpy", "aiohttp", "websockets", "tritonclient", "av"}
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["client"] == [] and "torch" in {import_name(r) for r in extras["serve"]}

    version = run_in(client_venv, "cosyvoice-triton", "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"cosyvoice-triton {cosyvoice_triton.__version__}"
    serve = run_in(client_venv, "cosyvoice-triton", "serve", cwd=tmp_path)
    assert serve.returncode == 2 and "pip install 'cosyvoice-triton[serve]'" in serve.stderr, serve.stderr
    assert "Traceback" not in serve.stderr
    helped = run_in(client_venv, "cosyvoice-client", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "usage: cosyvoice-client" in helped.stdout


def test_a_client_install_streams_from_the_gateway_and_from_triton(client_venv, tmp_path_factory, tmp_path,
                                                                     tiny_model_dir):
    with serve_stack(tmp_path_factory.mktemp("client_stack"), tiny_model_dir) as stack:
        streams = run_in(client_venv, "python", "-c", STREAMS, stack.gateway_url, stack.triton.grpc_url,
                         cwd=tmp_path)
        assert streams.returncode == 0, streams.stdout[-2000:] + streams.stderr[-3000:]
        seen = json.loads(streams.stdout.strip().splitlines()[-1])
        for path, (chunks, samples) in seen.items():
            assert chunks >= 1 and samples > 0, (path, seen)
        # The command line, streamed: the mp3 is encoded here, with PyAV, as the chunks come.
        out = tmp_path / "hello.mp3"
        cli = run_in(client_venv, "cosyvoice-client", "synth", "--url", stack.gateway_url, "--text", "Hello there.",
                     "--voice", "default", "--seed", "1", "--stream", "--out", str(out), cwd=tmp_path)
        assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
        assert out.stat().st_size > 0 and out.read_bytes()[:3] in (b"ID3", b"\xff\xfb", b"\xff\xf3", b"\xff\xf2")
