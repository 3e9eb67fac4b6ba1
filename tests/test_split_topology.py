"""The split deployment as a user starts it: `cosyvoice-triton up --frontends 2 --backends 1` (three
tritonservers, a redis-server and the gateway from one command, tiny random folder).

Its audio must equal the single-server pipeline for the same seeds (the library's own pipeline, which
tests/test_triton_serving.py holds the single server to), and it must survive losing a frontend: streams
there end with an error instead of hanging, new requests go to the other frontend, and the backend frees
the dead frontend's stream state by its idle timeout.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from cosyvoice_triton.client import GatewayTTS
from cosyvoice_triton.server import free_port
from test_triton_serving import ATOL, PROMPT_TEXT, RATE, RATIO, Reference, prompt_wav
from cli_harness import CliProcess
from triton_harness import metric_value, scrape, tritonserver_or_skip, wait_for_metric

pytestmark = pytest.mark.timeout(600)

IDLE_TIMEOUT_S = 12.0  # the backend frees a stream that gets no chunk for this long (a busy 2-core machine
# can leave 4 s between two chunks of one stream: a shorter limit cut live streams)
STREAMS = 4  # at once, spread over both frontends, all on the one backend
TEXTS = [f"Request number {i} asks the split deployment for a few words of speech." for i in range(STREAMS)]
LONG = ("This stream is long enough to still be running when its frontend is killed, so that the client sees "
        "the stream end. A second sentence keeps it going for a while longer, and then a third one follows.")


@dataclass
class Split:
    url: str
    layout: dict
    up: CliProcess


@pytest.fixture(scope="module")
def split(tiny_model_dir, tmp_path_factory):
    tritonserver_or_skip()
    from redis_harness import redis_binary_or_skip

    redis_binary_or_skip()
    run_dir = tmp_path_factory.mktemp("split")
    port = free_port()
    command = [sys.executable, "-m", "cosyvoice_triton.cli", "up", "--frontends", "2", "--backends", "1",
               "--no-official-ports",  # 8003 and 50000 are tests/test_gateway_up.py's
               "--model-dir", str(tiny_model_dir), "--run-dir", str(run_dir / "run"), "--host", "127.0.0.1",
               "--port", str(port), "--workers", "8", "--torch-threads", "1", "--max-token-text-ratio", str(RATIO),
               "--t2w-idle-timeout", str(IDLE_TIMEOUT_S),
               "--llm-precision", "fp32", "--flow-precision", "fp32",  # the reference's arithmetic on any CPU
               "--restart-delay", "3600",  # the killed frontend stays down (tests/test_faults.py: restarts)
               "--realtime-margin", "0"]  # every stream runs at once: the audio is compared, not admission
    up = CliProcess(command, {**os.environ, "COSYVOICE_HOME": str(run_dir / "home")})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _ready(url):
            assert up.running(), "up exited:\n" + up.output()
            assert time.monotonic() < deadline, "not ready in time:\n" + up.output()
            time.sleep(0.5)
        layout = json.loads((run_dir / "run" / "topology.json").read_text())
        yield Split(url, layout, up)
        assert up.interrupt(timeout_s=90) == 0, up.output()
    finally:
        up.kill()


def _ready(url: str) -> bool:
    try:
        return GatewayTTS(url, timeout_s=5)._json("GET", "/readyz").get("default_voice") == "ready"
    except Exception:  # noqa: BLE001 - not up yet
        return False


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> Reference:
    return Reference(tiny_model_dir)


def metric(metrics_url: str, name: str, **labels) -> float:
    return metric_value(scrape(metrics_url), name, **labels) or 0.0


def ok_requests(frontend: dict) -> float:
    """Requests served whole or streamed (the gateway sends non-streamed ones to cosyvoice2_offline)."""
    return sum(metric(frontend["metrics"], "cosyvoice_requests_total", model=model, outcome="ok")
               for model in ("cosyvoice2", "cosyvoice2_offline"))


def stream_all(url: str, text: str, voice_id: str, seed: int) -> np.ndarray:
    with GatewayTTS(url, timeout_s=120).stream(text, voice_id=voice_id, seed=seed) as chunks:
        return np.concatenate([chunk for chunk in chunks if chunk.size])


def run_threads(jobs: dict, timeout_s: float) -> dict:
    """Run each job in a thread; job name -> its result or the exception it raised. Fails on a hang."""
    results: dict = {}

    def run(name, job):
        try:
            results[name] = job()
        except Exception as exc:  # noqa: BLE001 - the caller looks at it
            results[name] = exc

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, timeout_s))
    hung = [name for name, thread in zip(jobs, threads) if thread.is_alive()]
    assert not hung, f"clients still waiting after {timeout_s} s: {hung}"
    return results


def test_the_layout_has_two_frontends_one_backend_and_redis(split):
    frontends, backends = split.layout["frontends"], split.layout["backends"]
    assert len(frontends) == 2 and len(backends) == 1 and split.layout["voice_store"].startswith("redis://")
    backend_metrics = scrape(backends[0]["metrics"])
    assert 'model="token2wav"' in backend_metrics and 'model="cosyvoice2"' not in backend_metrics
    for frontend in frontends:
        text = scrape(frontend["metrics"])
        assert 'model="cosyvoice2"' in text and 'model="token2wav"' not in text
        # The frontend's view of its backends: one, healthy, no stream open yet.
        for name, want in (("backends", 1), ("healthy", 1), ("streams", 0)):
            assert metric_value(text, f"cosyvoice_remote_token2wav_{name}", model="cosyvoice2") == want, name


def test_concurrent_streams_equal_the_single_server_audio(split, reference):
    wav = prompt_wav(3)
    voice = GatewayTTS(split.url).add_voice(wav, PROMPT_TEXT, sample_rate=RATE)
    frontends, backend = split.layout["frontends"], split.layout["backends"][0]
    served_before = [ok_requests(f) for f in frontends]
    finalized_before = metric(backend["metrics"], "cosyvoice_token2wav_streams_freed_total", reason="finalize")

    got = run_threads({i: (lambda i=i: stream_all(split.url, TEXTS[i], voice.voice_id, 100 + i))
                       for i in range(STREAMS)}, timeout_s=300)

    errors = {i: r for i, r in got.items() if isinstance(r, Exception)}
    assert not errors, errors
    voice_features = reference.voice(wav)
    for i, audio in got.items():
        want = np.concatenate(reference.chunks(TEXTS[i], voice_features, seed=100 + i))
        assert audio.size == want.size, f"stream {i}"
        np.testing.assert_allclose(audio, want, rtol=0, atol=ATOL, err_msg=f"stream {i}")
    # Both frontends took streams, and all token2wav work went to the one backend.
    served = [ok_requests(f) - before for f, before in zip(frontends, served_before)]
    assert sum(served) == STREAMS and min(served) >= 1, served
    finalized = metric(backend["metrics"], "cosyvoice_token2wav_streams_freed_total", reason="finalize")
    assert finalized - finalized_before >= STREAMS  # one token2wav stream per sentence, each ended by its final chunk
    for frontend in frontends:  # every pin was released with its stream's final chunk
        assert metric(frontend["metrics"], "cosyvoice_remote_token2wav_streams", model="cosyvoice2") == 0


def test_killing_a_frontend_mid_run_moves_new_requests_to_the_other(split):
    """Runs last in this module: it leaves the topology with one frontend."""
    voice = GatewayTTS(split.url).add_voice(prompt_wav(5), PROMPT_TEXT, sample_rate=RATE)
    dead, alive = split.layout["frontends"]
    backend = split.layout["backends"][0]
    started = [threading.Event() for _ in range(4)]

    def long_stream(i: int) -> int:
        samples = 0
        with GatewayTTS(split.url, timeout_s=120).stream(LONG, voice_id=voice.voice_id, seed=40 + i) as chunks:
            for chunk in chunks:
                samples += chunk.size
                started[i].set()
        return samples

    results: dict = {}
    runner = threading.Thread(target=lambda: results.update(
        run_threads({i: (lambda i=i: long_stream(i)) for i in range(4)}, timeout_s=240)), daemon=True)
    runner.start()
    for event in started:
        assert event.wait(120), "a stream gave no audio:\n" + split.up.output()
    assert metric(dead["metrics"], "cosyvoice_active_streams", model="cosyvoice2") >= 1  # streams on both
    os.killpg(dead["pid"], signal.SIGKILL)
    runner.join(timeout=250)
    assert not runner.is_alive() and len(results) == 4, "a client hangs"
    failed = [r for r in results.values() if isinstance(r, Exception)]
    assert 1 <= len(failed) < 4, results  # the dead frontend's streams end with an error; the others finish

    ok_before = ok_requests(alive)
    audio = run_threads({i: (lambda i=i: GatewayTTS(split.url, timeout_s=120).synthesize(
        TEXTS[i], voice_id=voice.voice_id, seed=i)) for i in range(3)}, timeout_s=240)
    assert all(isinstance(a, np.ndarray) and a.size > 0 for a in audio.values()), audio
    assert ok_requests(alive) - ok_before == 3  # every new request went to the live frontend
    ready = GatewayTTS(split.url)._json("GET", "/readyz")
    assert ready["servers"] == {dead["grpc"]: False, alive["grpc"]: True}
    # The backend frees the state of the streams whose frontend died (idle timeout).
    assert wait_for_metric(backend["metrics"], "cosyvoice_token2wav_active_streams", lambda v: v == 0,
                           timeout_s=IDLE_TIMEOUT_S * 10) == 0
    assert split.up.running()  # the service carries on with one frontend
