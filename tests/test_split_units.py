"""Split deployment pieces without servers: which models each role serves, and how a frontend spreads
token2wav streams over its backends (`RemoteToken2Wav` over a scripted transport; tests/
test_split_topology.py runs the real thing over gRPC)."""
from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import torch

from cosyvoice_triton.errors import InvalidInput, Unavailable, Unreachable
from cosyvoice_triton.messages import ChunkRequest, FlowPrompt
from cosyvoice_triton.server.launcher import ServeOptions, render_run_repository, role_models
from cosyvoice_triton.targets import TritonTarget
from cosyvoice_triton.triton.remote_token2wav import PoolStats, RemoteToken2Wav, Transport
from cosyvoice_triton.errors import RemoteError
from cosyvoice_triton.triton.pb_glue import remote_error

MODELS = ["audio_tokenizer", "cosyvoice2", "cosyvoice2_offline", "llm", "prompt_audio", "prompt_encoder",
          "register_voice", "speaker_embedding", "token2wav"]
PROMPT = FlowPrompt(speech_tokens=torch.zeros(1, 4, dtype=torch.int64), mel=torch.zeros(1, 8, 80),
                    embedding=torch.zeros(1, 192))


# ---- roles -------------------------------------------------------------------------------------------

def test_each_role_serves_its_side_of_the_graph():
    assert role_models(ServeOptions(), MODELS) == MODELS
    assert role_models(ServeOptions(role="backend"), MODELS) == ["token2wav"]
    frontend = role_models(ServeOptions(role="frontend", backends=("grpc://b:8001",)), MODELS)
    assert "token2wav" not in frontend and {"cosyvoice2", "llm", "prompt_encoder", "register_voice"} <= set(frontend)


@pytest.mark.parametrize("options, message", [
    (ServeOptions(role="frontend"), "at least one token2wav backend"),
    (ServeOptions(role="all", backends=("grpc://b:8001",)), "--backend is for --role frontend"),
    (ServeOptions(role="frontend", backends=("http://b:8001",)), "expected grpc://host:port"),
    (ServeOptions(role="edge"), "role must be one of"),
])
def test_bad_role_options_are_refused_before_any_server_starts(options, message):
    with pytest.raises(ValueError, match=message):
        role_models(options, MODELS)


def test_a_frontend_config_names_its_backends(tmp_path):
    options = ServeOptions(role="frontend", backends=("grpc://b1:8001", "b2:9001?metrics=http://b2:9100/metrics"))
    repo = render_run_repository(options, tmp_path / "model", "redis://r:6379/0", tmp_path / "repo")
    assert not (repo / "token2wav").exists()
    config = (repo / "cosyvoice2" / "config.pbtxt").read_text()
    assert ('"grpc://b1:8001?metrics=http://b1:8002/metrics,grpc://b2:9001?metrics=http://b2:9100/metrics"'
            in config)
    local = render_run_repository(ServeOptions(), tmp_path / "model", "v.sqlite", tmp_path / "repo-all")
    assert 'key: "token2wav_backends" value: { string_value: "" }' in (local / "cosyvoice2" / "config.pbtxt").read_text()


# ---- RemoteToken2Wav ---------------------------------------------------------------------------------

class ScriptedTransport:
    """A backend as RemoteToken2Wav sees it: records calls; `down` makes it unreachable, `full` busy."""

    def __init__(self, target: TritonTarget, timeout_s: float):
        self.target = target
        self.calls: list[tuple[str, bool, bool]] = []  # (stream id, first chunk, cancel)
        self.down = False
        self.full = False
        self.active: float | None = 0.0

    def infer(self, model, inputs, request_id):
        if self.down:
            raise Unreachable("connection refused")
        stream_id = inputs["stream_id"].reshape(-1)[0].decode()
        cancel = "cancel" in inputs
        first = "prompt_mel" in inputs
        if self.full and first:
            raise remote_error(model, "token2wav is full", 4)
        self.calls.append((stream_id, first, cancel))
        return {"waveform": np.full((1, 3), len(self.calls), np.float32)}

    def ready(self, model, timeout_s):
        return not self.down

    def active_streams(self, model, timeout_s):
        return self.active

    def close(self):
        pass


def pool(n: int = 2, watch_interval_s: float = 0.0) -> tuple[RemoteToken2Wav, list[ScriptedTransport]]:
    specs = [f"grpc://b{i}:8001" for i in range(n)]
    remote = RemoteToken2Wav(specs, watch_interval_s=watch_interval_s, transport_factory=ScriptedTransport)
    return remote, [b.client for b in remote.backends]


def first(stream_id: str) -> ChunkRequest:
    return ChunkRequest(stream_id=stream_id, tokens=[1, 2], finalize=False, prompt=PROMPT, seed=1)


def later(stream_id: str, finalize: bool = False) -> ChunkRequest:
    return ChunkRequest(stream_id=stream_id, tokens=[3], finalize=finalize, prompt=None, seed=None)


def test_streams_spread_by_outstanding_work_and_stay_on_their_backend():
    remote, (b0, b1) = pool()
    for stream_id in ("s1", "s2", "s3"):
        remote.chunk(first(stream_id))
    assert remote.pinned() == {"s1": "b0:8001", "s2": "b1:8001", "s3": "b0:8001"}
    remote.chunk(later("s2"))
    remote.chunk(later("s1", finalize=True))  # s1 ends: b0 has one stream left, b1 one
    assert [c[0] for c in b1.calls] == ["s2", "s2"] and [c[0] for c in b0.calls] == ["s1", "s3", "s1"]
    assert remote.pinned() == {"s2": "b1:8001", "s3": "b0:8001"}
    remote.backends[1].external = 5  # other frontends' streams on b1
    remote.chunk(first("s4"))
    remote.chunk(first("s5"))
    assert remote.pinned()["s4"] == "b0:8001" and remote.pinned()["s5"] == "b0:8001"


def test_cancel_goes_to_the_streams_backend_and_frees_the_pin():
    remote, (b0, b1) = pool()
    remote.chunk(first("a"))
    remote.chunk(first("b"))
    remote.cancel("b")
    assert b1.calls[-1] == ("b", False, True) and "b" not in remote.pinned()
    remote.cancel("never-opened")  # nothing to do
    assert len(b0.calls) + len(b1.calls) == 3


def test_a_first_chunk_moves_on_from_a_dead_or_full_backend():
    remote, (b0, b1) = pool()
    b0.down = True
    out = remote.chunk(first("s1"))
    assert out.size == 3 and remote.pinned() == {"s1": "b1:8001"} and not remote.backends[0].healthy
    b1.full = True  # the only healthy backend is full: nowhere to go
    with pytest.raises(Unavailable, match="no token2wav backend can take a new stream"):
        remote.chunk(first("s2"))
    assert "s2" not in remote.pinned()


def test_a_bad_request_is_not_retried_elsewhere():
    remote, (b0, b1) = pool()

    def refuse(model, inputs, request_id):
        raise remote_error(model, "tokens: out of range", 3)

    b0.infer = refuse
    with pytest.raises(RemoteError, match="out of range"):
        remote.chunk(first("s1"))
    assert b1.calls == []


class FailedCall(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = ""):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code, details, ready, kind", [
    (grpc.StatusCode.DEADLINE_EXCEEDED, "", True, Unreachable),  # no answer in time: leaves the pool
    (grpc.StatusCode.UNAVAILABLE, "connection refused", False, Unreachable),  # the server is gone
    (grpc.StatusCode.UNAVAILABLE, "busy", True, Unavailable),  # it answers: another backend for a first chunk
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "full", True, Unavailable),
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidInput("tokens", "out of range").to_wire(), True, InvalidInput),
    (grpc.StatusCode.INTERNAL, "boom", True, None),  # raised as the backend's internal error
])
def test_a_failed_grpc_call_becomes_unreachable_or_the_backends_error(code, details, ready, kind):
    transport = Transport(TritonTarget.parse("grpc://127.0.0.1:1", "token2wav_backends"), timeout_s=1.0)
    transport.ready = lambda model, timeout_s: ready
    try:
        error = transport._error(FailedCall(code, details), "token2wav")
    finally:
        transport.close()
    if kind is Unreachable:
        assert isinstance(error, Unreachable)
    else:  # the backend answered: its error, of its kind
        assert isinstance(error, RemoteError) and not isinstance(error, Unreachable)
        assert isinstance(error.error, kind) if kind else error.error.code == "internal"


def test_a_stream_whose_backend_dies_ends_with_unavailable():
    remote, (b0, _) = pool()
    remote.chunk(first("s1"))
    b0.down = True
    with pytest.raises(Unavailable, match="went away mid-stream"):
        remote.chunk(later("s1"))
    assert remote.pinned() == {} and remote.backends[0].inflight == 0
    with pytest.raises(Unavailable, match="has no backend"):
        remote.chunk(later("s1"))


def test_the_watcher_returns_a_backend_that_answers_again_and_reads_other_frontends_streams():
    remote, (b0, b1) = pool(watch_interval_s=0.05)
    try:
        b0.down = True
        remote.chunk(first("s1"))  # b0 fails: s1 lands on b1, b0 leaves the pool
        assert not remote.backends[0].healthy
        b0.down = False
        b1.active = 4.0  # b1 holds s1 (ours) and 3 streams of other frontends
        deadline = time.monotonic() + 5
        while not (remote.backends[0].healthy and remote.backends[1].external == 3.0):
            assert time.monotonic() < deadline, "the watcher did not catch up"
            time.sleep(0.02)
        remote.chunk(first("s2"))
        assert remote.pinned()["s2"] == "b0:8001"
    finally:
        remote.close()


def test_concurrent_streams_keep_exact_counts():
    remote, _ = pool(3)

    def one(i: int) -> None:
        remote.chunk(first(f"s{i}"))
        remote.chunk(later(f"s{i}", finalize=True))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert remote.pinned() == {} and [b.inflight for b in remote.backends] == [0, 0, 0]


def test_backends_found_in_dns_join_and_leave_the_pool():
    answers = {"ips": ["10.0.0.1"]}
    remote = RemoteToken2Wav(["dns://t2w-headless:8001"], watch_interval_s=0.0, transport_factory=ScriptedTransport,
                             resolve=lambda host, port: list(answers["ips"]))
    assert [b.name for b in remote.backends] == ["10.0.0.1:8001"]
    assert remote.backends[0].client.target.metrics_url == "http://10.0.0.1:8002/metrics"
    remote.chunk(first("s1"))
    old = remote.backends[0]
    answers["ips"] = ["10.0.0.2", "10.0.0.3"]  # the autoscaler replaced the pod and added one
    remote._refresh_members()
    assert old.leaving and not old.healthy  # no new streams there, but s1 finishes where its state is
    remote.chunk(first("s2"))
    assert remote.pinned()["s2"] in ("10.0.0.2:8001", "10.0.0.3:8001")
    remote.chunk(later("s1", finalize=True))
    assert old.client.calls[-1] == ("s1", False, False)
    answers["ips"] = []  # a DNS hiccup keeps what is known
    remote._refresh_members()
    assert sorted(b.name for b in remote.backends) == ["10.0.0.2:8001", "10.0.0.3:8001"]


def test_a_dns_name_that_resolves_to_nothing_yet_gives_unavailable():
    remote = RemoteToken2Wav(["dns://t2w-headless:8001"], watch_interval_s=0.0, transport_factory=ScriptedTransport,
                             resolve=lambda host, port: [])
    with pytest.raises(Unavailable, match="no token2wav backend"):
        remote.chunk(first("s1"))
    with pytest.raises(ValueError, match="expected dns://name:port"):
        RemoteToken2Wav(["dns://no-port"], watch_interval_s=0.0, transport_factory=ScriptedTransport)


def test_a_frontend_may_find_its_backends_in_dns(tmp_path):
    options = ServeOptions(role="frontend", backends=("dns://cosyvoice-backend-pods:8001",))
    repo = render_run_repository(options, tmp_path / "model", "redis://r:6379/0", tmp_path / "repo")
    assert '"dns://cosyvoice-backend-pods:8001"' in (repo / "cosyvoice2" / "config.pbtxt").read_text()


def test_pool_stats_and_change_notices():
    remote, (b0, _) = pool()
    changes = []
    remote.on_change = lambda: changes.append(remote.stats())
    remote.chunk(first("s1"))
    assert remote.stats() == PoolStats(backends=2, healthy=2, open_streams=1, failures=0)
    b0.down = True
    with pytest.raises(Unavailable):
        remote.chunk(later("s1"))
    assert changes == [PoolStats(backends=2, healthy=1, open_streams=0, failures=1)]
