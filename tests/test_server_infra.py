"""The Triton plumbing: templates, finding tritonserver, and a real server streaming the echo_stream model."""
from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.server import (PythonEnv, TemplateError, TritonNotFound, TritonProcess, TritonStartError,
                                     find_tritonserver, free_port, model_names, render_repository,
                                     render_template, server_environment)
from cosyvoice_triton.server.binary import TritonBinary, stage_backend_directory, stub_python_version
from triton_harness import (ECHO_VALUES, TEST_MODELS, GrpcStream, metric_samples, metric_value, scrape,
                            server_fixture, tritonserver_or_skip, wait_for_metric)

echo_server = server_fixture(TEST_MODELS, {"echo_stream": ECHO_VALUES}, ["echo_stream"])


# -- templates -------------------------------------------------------------------------------------

def test_render_template_fills_every_placeholder():
    text = 'a: ${a}\nb: "${path}"\nc: ${flag} ${a}\n'
    out = render_template(text, {"a": 3, "path": Path("/m/x"), "flag": True})
    assert out == 'a: 3\nb: "/m/x"\nc: true 3\n'


@pytest.mark.parametrize("text, values, problem", [
    ("x: ${a} ${b}", {"a": 1}, "no value for b"),
    ("x: ${a}", {"a": 1, "zz": 2}, "unknown keys zz"),
    ("x: ${ a}", {}, "left over at line 1"),
    ("x: 1\ny: ${2a}", {}, "left over at line 2"),
    ("x: ${a}", {"a": "${b}"}, "left over"),
    ("x: ${a}", {"a": "two\nlines"}, "line break"),
    ("x: ${a}", {"a": [1, 2]}, "has type list"),
])
def test_render_template_refuses(text, values, problem):
    with pytest.raises(TemplateError, match=problem):
        render_template(text, values)


def test_render_repository_renders_config_and_links_files(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    dst = render_repository(TEST_MODELS, tmp_path / "run", {"echo_stream": {"instances": 2, "max_n": 7}})
    assert model_names(dst) == ["echo_stream"]
    config = text_format.Parse((dst / "echo_stream" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.instance_group[0].count == 2
    assert config.parameters["max_n"].string_value == "7"
    assert config.model_transaction_policy.decoupled
    model_py = dst / "echo_stream" / "1" / "model.py"
    assert model_py.is_symlink() and model_py.resolve() == (TEST_MODELS / "echo_stream" / "1" / "model.py")

    copied = render_repository(TEST_MODELS, tmp_path / "copy", {"echo_stream": ECHO_VALUES}, link=False)
    assert not (copied / "echo_stream" / "1" / "model.py").is_symlink()


def test_render_repository_refuses_bad_requests(tmp_path):
    with pytest.raises(TemplateError, match="no model folder .* for nope"):
        render_repository(TEST_MODELS, tmp_path / "a", {}, ["nope"])
    with pytest.raises(TemplateError, match="models not laid out: other"):
        render_repository(TEST_MODELS, tmp_path / "b", {"echo_stream": ECHO_VALUES, "other": {}})
    with pytest.raises(TemplateError, match="no value for instances, max_n"):
        render_repository(TEST_MODELS, tmp_path / "c", {})
    assert not (tmp_path / "c" / "echo_stream").exists()  # nothing laid out when a template fails
    render_repository(TEST_MODELS, tmp_path / "d", {"echo_stream": ECHO_VALUES})
    with pytest.raises(TemplateError, match="already exists"):
        render_repository(TEST_MODELS, tmp_path / "d", {"echo_stream": ECHO_VALUES})
    render_repository(TEST_MODELS, tmp_path / "d", {"echo_stream": {"instances": 1, "max_n": 5}}, overwrite=True)
    assert 'string_value: "5"' in (tmp_path / "d" / "echo_stream" / "config.pbtxt").read_text()
    with pytest.raises(TemplateError, match="inside the source"):
        render_repository(TEST_MODELS, TEST_MODELS / "x", {"echo_stream": ECHO_VALUES})


# -- binary and environment -------------------------------------------------------------------------

def test_tritonserver_env_var_must_be_executable(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONSERVER", str(tmp_path / "missing"))
    with pytest.raises(TritonNotFound, match="not an executable"):
        find_tritonserver()


def _fake_install(root: Path, python_version: str = "3.11") -> Path:
    """An NGC-style install at `root`: bin/tritonserver (an executable script), lib/, and a Python
    backend whose stub names libpython`python_version`."""
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "backends" / "python").mkdir(parents=True)
    (root / "backends" / "python" / "triton_python_backend_stub").write_bytes(
        b"\x7fELF...libpython" + python_version.encode() + b".so.1.0...")
    executable = root / "bin" / "tritonserver"
    executable.write_text("#!/bin/sh\nexit 0\n")
    executable.chmod(0o755)
    return executable


@pytest.fixture
def no_wheel_binary(monkeypatch, tmp_path):
    """find_tritonserver as in a container without the nvidia-pytriton wheel: no $TRITONSERVER, and
    neither PATH nor the NGC location holds a tritonserver unless a test puts one there."""
    from cosyvoice_triton.server import binary as binary_module

    monkeypatch.delenv("TRITONSERVER", raising=False)
    monkeypatch.setattr(binary_module, "_pytriton_binary", lambda: None)
    monkeypatch.setattr(binary_module, "NGC_EXECUTABLE", tmp_path / "opt" / "tritonserver" / "bin" / "tritonserver")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return binary_module


def test_tritonserver_on_path_is_found(no_wheel_binary, monkeypatch, tmp_path):
    executable = _fake_install(tmp_path / "install")
    monkeypatch.setenv("PATH", f"{tmp_path / 'empty-bin'}:{executable.parent}")
    found = find_tritonserver()
    assert found.source == "path" and found.executable == executable.resolve()
    assert found.backend_dir == tmp_path / "install" / "backends"
    assert found.library_dirs == (tmp_path / "install" / "lib",) and found.stubs_dir is None
    assert found.stub_path("3.11") == found.backend_dir / "python" / "triton_python_backend_stub"
    with pytest.raises(TritonNotFound, match="built for Python 3.11"):
        found.stub_path("3.12")  # the container's stub serves its own Python only
    assert stage_backend_directory(found, tmp_path / "staged", "3.11") == found.backend_dir


def test_tritonserver_at_the_ngc_location_is_found(no_wheel_binary, monkeypatch, tmp_path):
    with pytest.raises(TritonNotFound, match="tritonserver on PATH and .*opt/tritonserver/bin/tritonserver"):
        find_tritonserver()
    executable = _fake_install(tmp_path / "opt" / "tritonserver")
    assert executable == no_wheel_binary.NGC_EXECUTABLE
    found = find_tritonserver()
    assert found.source == "path" and found.executable == executable.resolve()
    assert found.backend_dir == tmp_path / "opt" / "tritonserver" / "backends"
    # PATH comes first; a file that is not executable does not count.
    other = _fake_install(tmp_path / "other")
    other.chmod(0o644)
    monkeypatch.setenv("PATH", f"{other.parent}:{tmp_path / 'empty-bin'}")
    assert find_tritonserver().executable == executable.resolve()
    other.chmod(0o755)
    assert find_tritonserver().executable == other.resolve()


def test_stub_for_this_python():
    binary = tritonserver_or_skip()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert stub_python_version(binary.stub_path(version)) == version
    if binary.stubs_dir is not None:
        with pytest.raises(TritonNotFound, match="no Python backend stub for Python 2.7"):
            binary.stub_path("2.7")


def test_server_environment_puts_the_venv_first():
    binary = TritonBinary(executable=Path("/x/bin/tritonserver"), backend_dir=Path("/x/backends"),
                          source="env", library_dirs=(Path("/x/libs"),))
    env = PythonEnv(prefix=Path("/venv"), bin_dir=Path("/venv/bin"), version="3.11",
                    libpython_dir=Path("/py/lib"), libpython_name="libpython3.11.so.1.0")
    out = server_environment(binary, env, pythonpath=["/src"], extra={"OMP_NUM_THREADS": "1"},
                             base={"PATH": "/usr/bin", "PYTHONHOME": "/elsewhere", "LD_LIBRARY_PATH": "/cuda",
                                   "PYTHONPATH": "/old"})
    assert out["PATH"] == "/venv/bin:/usr/bin"
    assert out["LD_LIBRARY_PATH"] == "/py/lib:/cuda:/x/libs"
    assert out["PYTHONPATH"] == "/src:/old"
    assert "PYTHONHOME" not in out and out["OMP_NUM_THREADS"] == "1"


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_process_argument_checks(tmp_path):
    binary = TritonBinary(executable=Path("/x/bin/tritonserver"), backend_dir=Path("/x/backends"), source="env")
    with pytest.raises(ValueError, match="model_control_mode"):
        TritonProcess(tmp_path, binary=binary, model_control_mode="sometimes")
    with pytest.raises(ValueError, match="explicit"):
        TritonProcess(tmp_path, binary=binary, load_models=["a"])
    with pytest.raises(FileNotFoundError):
        TritonProcess(tmp_path / "none", binary=binary)


def test_a_server_killed_by_a_signal_while_starting_is_started_once_more(tmp_path, caplog):
    """python_backend now and then aborts while its stubs start on a busy machine: the first launch here is
    killed by SIGABRT before it is ready (a wrapper around the real binary); the second one serves. A second
    crash is not retried."""
    import dataclasses
    import logging

    real = tritonserver_or_skip()
    marker, wrapper = tmp_path / "launched", tmp_path / "tritonserver"
    wrapper.write_text(f'#!/bin/bash\nif [ ! -e {marker} ]; then touch {marker}; kill -ABRT $$; fi\n'
                       f'exec {real.executable} "$@"\n')
    wrapper.chmod(0o755)
    repo = render_repository(TEST_MODELS, tmp_path / "repo", {"echo_stream": ECHO_VALUES}, ["echo_stream"])
    server = TritonProcess(repo, workdir=tmp_path / "run", binary=dataclasses.replace(real, executable=wrapper))
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton.server.process"), server:
        assert server.is_ready()
        with urllib.request.urlopen(server.metrics_url, timeout=5) as response:  # start waits for it too
            assert b"nv_inference_request_success" in response.read()
    assert [r.getMessage().split(" (log")[0] for r in caplog.records] == [
        "tritonserver was killed by signal 6 before it was ready"]

    always = tmp_path / "always-aborts"
    always.write_text("#!/bin/bash\nkill -ABRT $$\n")
    always.chmod(0o755)
    server = TritonProcess(repo, workdir=tmp_path / "run2", binary=dataclasses.replace(real, executable=always))
    with pytest.raises(TritonStartError, match="exited with code -6"):
        server.start()
    assert not server.is_running()


def test_start_fails_fast_with_the_log_tail(tmp_path):
    binary = tritonserver_or_skip()
    model = tmp_path / "repo" / "broken"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n'
                                        'input [{ name: "x" data_type: TYPE_FP32 dims: [1] }]\n'
                                        'output [{ name: "y" data_type: TYPE_FP32 dims: [1] }]\n')
    (model / "1" / "model.py").write_text("raise ImportError('broken model on purpose')\n")
    server = TritonProcess(tmp_path / "repo", workdir=tmp_path / "run", binary=binary, startup_timeout_s=120)
    with pytest.raises(TritonStartError, match="(?s)exited with code.*broken model on purpose"):
        server.start()
    assert not server.is_running()
    assert not list(Path("/dev/shm").glob(server.shm_region_prefix + "*"))


# -- a real server ---------------------------------------------------------------------------------

def echo_inputs(text: str, n: int, delay_ms: int | None = None) -> dict:
    values = {"text": np.array([text.encode()], dtype=object), "n": np.array([n], dtype=np.int32)}
    if delay_ms is not None:
        values["delay_ms"] = np.array([delay_ms], dtype=np.int32)
    return values


def test_http_endpoint_is_ready(echo_server):
    import tritonclient.http as httpclient

    with urllib.request.urlopen(f"http://{echo_server.http_url}/v2/health/ready", timeout=5) as resp:
        assert resp.status == 200
    client = httpclient.InferenceServerClient(echo_server.http_url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("echo_stream")
    finally:
        client.close()


def test_stream_arrives_in_order_with_final_flag(echo_server):
    with GrpcStream(echo_server.grpc_url) as stream:
        responses = stream.infer("echo_stream", echo_inputs("héllo", 5))
    assert [r.error for r in responses] == [None] * 6
    assert [r.final for r in responses] == [False] * 5 + [True]
    assert [int(r.outputs["index"][0]) for r in responses[:5]] == [0, 1, 2, 3, 4]
    for i, r in enumerate(responses[:5]):
        np.testing.assert_array_equal(r.outputs["chunk"], np.full(6, i, dtype=np.float32))  # 6 UTF-8 bytes
    assert responses[-1].outputs == {}


def test_many_requests_on_one_stream(echo_server):
    with GrpcStream(echo_server.grpc_url) as stream:
        ids = {stream.send("echo_stream", echo_inputs("ab", n)): n for n in (0, 3, 1, 4)}
        for request_id, n in ids.items():
            responses = stream.collect(request_id)
            assert [int(r.outputs["index"][0]) for r in responses[:-1]] == list(range(n))
            assert responses[-1].final and all(not r.final for r in responses[:-1])


def test_bad_input_names_the_field(echo_server):
    with GrpcStream(echo_server.grpc_url) as stream:
        responses = stream.infer("echo_stream", echo_inputs("x", ECHO_VALUES["max_n"] + 1))
    assert len(responses) == 1 and responses[0].error is not None
    assert "n: must be in" in responses[0].error


def test_custom_metrics_reach_the_metrics_port(echo_server):
    before = metric_value(scrape(echo_server.metrics_url), "echo_stream_responses_total") or 0.0
    with GrpcStream(echo_server.grpc_url) as stream:
        stream.infer("echo_stream", echo_inputs("m", 4))
    text = scrape(echo_server.metrics_url)
    assert metric_value(text, "echo_stream_responses_total", model="echo_stream") >= before + 4
    assert "# TYPE echo_stream_requested_n histogram" in text
    buckets = {lab["le"] for lab, _ in metric_samples(text, "echo_stream_requested_n_bucket")}
    assert {"1", "4", "16", "64", "+Inf"} <= buckets
    wait_for_metric(echo_server.metrics_url, "echo_stream_active_streams", lambda v: v == 0)
    assert metric_value(text, "nv_inference_count", model="echo_stream") is not None  # Triton's own


def test_cancelled_stream_stops_and_server_still_serves(echo_server):
    cancelled = metric_value(scrape(echo_server.metrics_url), "echo_stream_cancelled_total") or 0.0
    stream = GrpcStream(echo_server.grpc_url)
    request_id = stream.send("echo_stream", echo_inputs("slow", ECHO_VALUES["max_n"], delay_ms=20))
    first = stream.next(request_id)
    assert first.error is None and int(first.outputs["index"][0]) == 0
    stream.close(cancel_requests=True)
    wait_for_metric(echo_server.metrics_url, "echo_stream_cancelled_total", lambda v: v >= cancelled + 1)
    wait_for_metric(echo_server.metrics_url, "echo_stream_active_streams", lambda v: v == 0)
    with GrpcStream(echo_server.grpc_url) as again:
        assert len(again.infer("echo_stream", echo_inputs("ok", 2))) == 3


def test_server_runs_the_project_environment(echo_server):
    # The model imports cosyvoice_triton; it loaded, so the stub ran this environment.
    assert echo_server.python_env.prefix == Path(sys.prefix)
    env = echo_server.environment()
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.prefix) / "bin")


# -- the same model without Triton ------------------------------------------------------------------

def test_echo_model_with_the_fake_pb_utils():
    import pb_fake

    template = (TEST_MODELS / "echo_stream" / "config.pbtxt").read_text()
    config = pb_fake.pbtxt_to_dict(render_template(template, {"instances": 1, "max_n": 10}))
    assert config["parameters"]["max_n"]["string_value"] == "10"
    with pb_fake.installed() as pb:
        model = pb_fake.load_model(TEST_MODELS / "echo_stream" / "1" / "model.py").TritonPythonModel()
        model.initialize(pb_fake.initialize_args(config))
        try:
            ok = pb.InferenceRequest(inputs=[pb.Tensor(k, v) for k, v in echo_inputs("ab", 3).items()])
            bad = pb.InferenceRequest(inputs=[pb.Tensor(k, v) for k, v in echo_inputs("ab", 11).items()])
            missing = pb.InferenceRequest(inputs=[pb.Tensor("text", np.array([b"x"], dtype=object))])
            assert model.execute([ok, bad, missing]) is None
            responses = ok.sender.wait_final(timeout=30)
            assert [int(r.outputs()["index"][0]) for r in responses] == [0, 1, 2]
            assert [f for _, f in ok.sender.sent] == [0, 0, 0, pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
            (error,) = [r.error() for r in bad.sender.wait_final(timeout=5)]
            assert error.code() == pb.TritonError.INVALID_ARG and error.message().startswith("n: ")
            (error,) = [r.error() for r in missing.sender.wait_final(timeout=5)]
            assert error.message() == "n: missing"

            slow = pb.InferenceRequest(inputs=[pb.Tensor(k, v) for k, v in echo_inputs("s", 10, 1000).items()])
            slow.cancel()
            model.execute([slow])
            (error,) = [r.error() for r in slow.sender.wait_final(timeout=30)]
            assert error.code() == pb.TritonError.CANCELLED
            family = pb.MetricFamily.registry["echo_stream_responses_total"]
            assert sum(m.value() for m in family.metrics) == 3
            assert pb.MetricFamily.registry["echo_stream_requested_n"].metrics[0].observations == [3.0, 10.0]
        finally:
            model.finalize()


def test_python_env_of_another_prefix_matches_the_current_one():
    assert PythonEnv.from_prefix(sys.prefix) == PythonEnv.current()
    with pytest.raises(TritonNotFound, match="not a Python environment"):
        PythonEnv.from_prefix("/nonexistent-env")


def test_tritonserver_env_var_names_the_binary(monkeypatch):
    found = tritonserver_or_skip()
    monkeypatch.setenv("TRITONSERVER", str(found.executable))
    chosen = find_tritonserver()
    assert chosen.source == "env"
    assert chosen.executable == found.executable.resolve() and chosen.stubs_dir == found.stubs_dir
