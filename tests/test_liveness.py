"""A tritonserver that runs but no longer answers is found and restarted (server/liveness.py with `up`'s
supervisor), on a real tritonserver of its own (tiny model):

- a healthy server's cosyvoice2 and llm answer the probes, which count as no request (no error, no stream);
- the cosyvoice2 stub frozen (SIGSTOP: what a deadlock inside it looks like from outside) makes the probes
  go unanswered; the supervisor kills the server and starts it again on the same address; a stream that
  was running fails visibly (an error, not a wait), and the restarted server synthesizes again.
"""
from __future__ import annotations

import os
import signal
import threading
import urllib.request

import pytest

from cosyvoice_triton.prometheus_text import metric_sum
from cosyvoice_triton.server.liveness import Liveness, answers
from cosyvoice_triton.server.supervisor import Backoff, Supervisor

from polling import wait_until
from web.stack import stub_pid, triton_server

pytestmark = pytest.mark.timeout(600)


def requests_counted(server) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        return metric_sum(response.read().decode(), "cosyvoice_requests_total", "cosyvoice2")


def test_a_frozen_server_is_killed_and_restarted_and_its_streams_fail(tmp_path, tiny_model_dir):
    from cosyvoice_triton.client import TritonTTS, TTSError

    with triton_server(tmp_path, tiny_model_dir, shared=False) as (server, _, _):
        before = requests_counted(server)
        for model in ("cosyvoice2", "llm"):
            assert answers(server.grpc_url, model, timeout_s=10)
        watch = Liveness(server, interval_s=0.3, timeout_s=1.0, hung_after=2)
        watch.probe_once()
        assert watch.hung is None and watch.probed_models() == ["cosyvoice2", "llm"]
        assert requests_counted(server) == before  # probes are no requests: no error, no stream

        supervisor = Supervisor({"tritonserver": server}, Backoff(initial_delay_s=0.1), liveness={"tritonserver": watch})
        address, outcome = server.grpc_url, {}
        tts = TritonTTS(address)
        text = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen."

        def listen():
            try:
                for _ in tts.stream(text, seed=1, **_prompt()):
                    outcome.setdefault("first", True)
                outcome["end"] = "completed"
            except TTSError as exc:
                outcome["end"] = exc.status

        try:
            supervisor.begin()
            listener = threading.Thread(target=listen)
            listener.start()
            wait_until(lambda: "first" in outcome or "end" in outcome, timeout_s=120)
            os.kill(stub_pid(server, "cosyvoice2"), signal.SIGSTOP)
            wait_until(lambda: supervisor.states()["tritonserver"]["hangs"] == 1, timeout_s=60)
            listener.join(timeout=60)
            assert outcome.get("end") not in (None, "completed"), outcome  # failed visibly, not waiting
            wait_until(lambda: supervisor.states()["tritonserver"]["restarts"] == 1, timeout_s=180)
            assert server.grpc_url == address
            audio = [chunk for chunk in TritonTTS(address).stream("Back again.", seed=2, **_prompt())]
            assert sum(chunk.size for chunk in audio) > 0
            assert watch.hung is None
        finally:
            supervisor.close(server.stop)


def _prompt() -> dict:
    """A reference recording for a stream that needs no registered voice."""
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    return {"prompt_audio": speech_like(2.0, 16000, seed=3), "prompt_sample_rate": 16000, "prompt_text": "A prompt."}
