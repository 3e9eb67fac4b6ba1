"""Faults and restarts of `cosyvoice-triton up --frontends 1 --backends 1` (two tritonservers, the
redis-server it starts and the gateway; tiny random folder), as an operator meets them:

* a tritonserver killed with SIGKILL mid-stream: that stream fails at once (no hang), `up` starts the
  server again on its port, `/readyz` and `/metrics` count the restart, new requests succeed;
* Redis killed (and kept from coming back for a while): clear 503s naming the voice store, `/readyz` 503,
  and once `up` has restarted it every voice is still there (its append-only file);
* SIGTERM under load: the streams in flight finish, every model unloads, both tritonservers and `up`
  exit 0, none of the run's /dev/shm regions is left;
* `up` started again on the same run folder: the voices are still there.

The tests run in this order on one service (the last two stop it). Pieces of this are tested without
tritonserver in tests/test_shutdown.py.
"""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.client import GatewayTTS
from cosyvoice_triton.server import free_port
from cosyvoice_triton.server.templates import model_names
from cli_harness import CliProcess
from polling import wait_until
from test_triton_serving import PROMPT_TEXT, RATE, RATIO, prompt_wav
from triton_harness import metric_value, scrape, tritonserver_or_skip

pytestmark = pytest.mark.timeout(900)

RESTART_DELAY_S = 2.0  # `up --restart-delay`: the test holds Redis's port well within it
STARTUP_TIMEOUT_S = 480
TEXT = "A few words."
LONG = ("This stream is long enough to be running when a server goes away. A second sentence keeps it "
        "going for a while longer, and then a third one follows it.")


@dataclass
class Service:
    url: str
    run_dir: Path
    home: Path
    up: CliProcess
    voice_id: str


def start_up(model_dir: Path, run_dir: Path, home: Path) -> tuple[str, CliProcess]:
    port = free_port()
    command = [sys.executable, "-m", "cosyvoice_triton.cli", "up", "--frontends", "1", "--backends", "1",
               "--no-official-ports",  # 8003 and 50000 are tests/test_gateway_up.py's
               "--model-dir", str(model_dir), "--run-dir", str(run_dir), "--host", "127.0.0.1",
               "--port", str(port), "--workers", "4", "--torch-threads", "1", "--max-token-text-ratio", str(RATIO),
               "--restart-delay", str(RESTART_DELAY_S), "--drain-timeout", "240",
               "--realtime-margin", "0"]  # every stream of the drain test runs at once (real-time admission off)
    up = CliProcess(command, {**os.environ, "COSYVOICE_HOME": str(home)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while http(url + "/readyz")[0] != 200:
        assert up.running(), "up exited:\n" + up.output()
        assert time.monotonic() < deadline, "not ready in time:\n" + up.output()
        time.sleep(0.5)
    return url, up


def http(url: str, body: dict | None = None, timeout_s: float = 30.0) -> tuple[int, dict]:
    """Status and JSON body (0 and {} when nothing answers)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw, status = response.read(), response.status
    except urllib.error.HTTPError as error:
        raw, status = error.read(), error.code
    except OSError:
        return 0, {}
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"bytes": len(raw)}


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    tritonserver_or_skip()
    from redis_harness import redis_binary_or_skip

    redis_binary_or_skip()
    root = tmp_path_factory.mktemp("faults")
    url, up = start_up(tiny_model_dir, root / "run", root / "home")
    try:
        voice = GatewayTTS(url).add_voice(prompt_wav(3), PROMPT_TEXT, sample_rate=RATE)
        yield Service(url, root / "run", root / "home", up, voice.voice_id)
    finally:
        up.kill()


def processes(url: str) -> dict:
    return http(url + "/readyz")[1].get("processes", {})


def restarted(url: str, name: str, times: int) -> bool:
    state = processes(url).get(name, {})
    return state.get("state") == "running" and state.get("restarts") == times


def gateway_metric(url: str, name: str, **labels) -> float | None:
    return metric_value(scrape(url + "/metrics"), name, **labels)


def stream_in_thread(url: str, text: str, voice_id: str, seed: int) -> tuple[threading.Thread, threading.Event, dict]:
    """A streamed /v1/tts in a thread: set `started` at its first audio; `result` gets samples or error."""
    started, result = threading.Event(), {}

    def run() -> None:
        samples = 0
        try:
            with GatewayTTS(url, timeout_s=240).stream(text, voice_id=voice_id, seed=seed) as chunks:
                for chunk in chunks:
                    samples += chunk.size
                    started.set()
            result["samples"] = samples
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            result["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, started, result


def test_a_tritonserver_killed_mid_stream_fails_that_stream_and_is_started_again(service):
    layout = json.loads((service.run_dir / "topology.json").read_text())
    backend = processes(service.url)["backend-0"]
    thread, started, result = stream_in_thread(service.url, LONG, service.voice_id, seed=7)
    assert started.wait(240) and "error" not in result, result
    os.killpg(backend["pid"], signal.SIGKILL)  # the token2wav server and its stubs, mid-stream
    thread.join(timeout=120)
    assert not thread.is_alive(), "the client still waits on a stream whose server died"
    assert "error" in result, f"a stream cut by a dead server ended as if complete: {result}"

    wait_until(lambda: restarted(service.url, "backend-0", 1), timeout_s=STARTUP_TIMEOUT_S)
    state = processes(service.url)["backend-0"]
    assert state["pid"] != backend["pid"] and state["last_exit_code"] == -signal.SIGKILL
    assert gateway_metric(service.url, "cosyvoice_gateway_process_restarts_total", process="backend-0") == 1
    assert gateway_metric(service.url, "cosyvoice_gateway_process_up", process="backend-0") == 1
    # Same port: the frontend finds its backend again.
    frontend_metrics = layout["frontends"][0]["metrics"]
    wait_until(lambda: metric_value(scrape(frontend_metrics), "cosyvoice_remote_token2wav_healthy",
                                    model="cosyvoice2") == 1, timeout_s=120)
    audio = GatewayTTS(service.url, timeout_s=240).synthesize(TEXT, voice_id=service.voice_id, seed=1)
    assert isinstance(audio, np.ndarray) and audio.size > 0


@contextmanager
def hold_port(port: int, timeout_s: float = 30.0):
    """Listen on 127.0.0.1:`port` as soon as its server is gone, closing every connection at once (a
    server that is down: clients fail fast), so that nothing else can serve there until the block ends."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the dead server's connections in TIME_WAIT
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(("127.0.0.1", port))
            break
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE and time.monotonic() < deadline, exc
            time.sleep(0.01)
    sock.listen(16)
    sock.settimeout(0.1)
    done = threading.Event()

    def refuse() -> None:
        while not done.is_set():
            try:
                sock.accept()[0].close()
            except TimeoutError:
                pass

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        sock.close()


def test_killing_redis_gives_clear_503s_and_loses_no_voice(service):
    redis = processes(service.url)["redis"]
    layout = json.loads((service.run_dir / "topology.json").read_text())
    port = int(re.search(r":(\d+)/", layout["voice_store"]).group(1))
    os.kill(redis["pid"], signal.SIGKILL)
    with hold_port(port):  # up's restarts fail (port taken) until the block ends
        status, ready = http(service.url + "/readyz")
        assert status == 503 and ready["ready"] is False and ready["voice_store"] == "unavailable", ready
        status, body = http(service.url + "/v1/tts", {"text": TEXT, "voice": service.voice_id, "seed": 1})
        assert status == 503 and "voice store" in body["error"]["message"], (status, body)
        status, body = http(service.url + "/v1/voices")
        assert status == 503 and "voice store" in body["error"]["message"], (status, body)
        wait_until(lambda: "last_error" in processes(service.url)["redis"], timeout_s=60)  # a failed restart
    wait_until(lambda: restarted(service.url, "redis", 1), timeout_s=120)
    wait_until(lambda: http(service.url + "/readyz")[0] == 200, timeout_s=60)
    assert service.voice_id in [v.voice_id for v in GatewayTTS(service.url).list_voices()]
    audio = GatewayTTS(service.url, timeout_s=240).synthesize(TEXT, voice_id=service.voice_id, seed=2)
    assert audio.size > 0


def shm_prefixes(run_dir: Path) -> list[str]:
    """The /dev/shm region prefixes of this run's tritonservers (from the command line in each log)."""
    logs = sorted(run_dir.glob("*-*/tritonserver.log"))
    assert len(logs) == 2, logs
    return [re.findall(r"shm-region-prefix-name=(\S+)", log.read_text())[-1] for log in logs]


def run_regions(prefixes: list[str]) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(tuple(prefixes)))


def last_launch(log: Path) -> str:
    text = log.read_text(errors="replace")
    return text[text.rindex("\n$ ") if "\n$ " in text else 0:]


def test_sigterm_under_load_drains_the_streams_and_leaves_nothing_behind(service):
    prefixes = shm_prefixes(service.run_dir)
    assert run_regions(prefixes), "the running servers should hold shm regions (wrong prefixes?)"
    streams = [stream_in_thread(service.url, LONG, service.voice_id, seed=20 + i) for i in range(3)]
    for _, started, result in streams:
        assert started.wait(240) and "error" not in result, result

    service.up.process.send_signal(signal.SIGTERM)
    code = service.up.process.wait(timeout=300)
    output = service.up.output()
    for thread, _, result in streams:
        thread.join(timeout=60)
        assert not thread.is_alive() and "samples" in result, f"{result}\n{output}"  # finished, not cut
    assert code == 0, output
    assert "drained" in output and "exit codes: frontend-0 0, backend-0 0" in output, output
    assert run_regions(prefixes) == []
    for role in ("frontend-0", "backend-0"):  # every model of each server unloaded
        log = last_launch(service.run_dir / role / "tritonserver.log")
        for name in model_names(service.run_dir / role / "repo"):
            assert f"successfully unloaded '{name}'" in log, f"{role}: {name} did not unload:\n{log[-3000:]}"


def test_up_started_again_on_its_run_folder_has_the_same_voices(service, tiny_model_dir):
    if service.up.running():  # the SIGTERM test failed before it stopped the service
        service.up.interrupt(timeout_s=300)
    url, up = start_up(tiny_model_dir, service.run_dir, service.home)
    try:
        assert service.voice_id in [v.voice_id for v in GatewayTTS(url).list_voices()]
        audio = GatewayTTS(url, timeout_s=240).synthesize(TEXT, voice_id=service.voice_id, seed=3)
        assert audio.size > 0
        assert up.interrupt(timeout_s=300) == 0, up.output()
    finally:
        up.kill()
