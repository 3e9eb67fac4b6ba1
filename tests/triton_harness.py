"""Helpers for tests against a real tritonserver: start one on free ports, stream over gRPC, read metrics.

```
from triton_harness import TEST_MODELS, server_fixture, GrpcStream

echo_server = server_fixture(TEST_MODELS, {"echo_stream": {"instances": 1, "max_n": 1000}})

def test_x(echo_server):
    with GrpcStream(echo_server.grpc_url) as stream:
        responses = stream.infer("echo_stream", {"text": ..., "n": ...})
```
A server fixture starts once per scope (session by default) and skips, naming the reason, when no
tritonserver can be found.
"""
from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.server import (TritonBinary, TritonNotFound, TritonProcess, find_tritonserver,
                                     render_repository)

TESTS_DIR = Path(__file__).resolve().parent
TEST_MODELS = TESTS_DIR / "models"
ECHO_VALUES = {"instances": 1, "max_n": 1000}


def tritonserver_or_skip() -> TritonBinary:
    try:
        return find_tritonserver()
    except TritonNotFound as exc:
        pytest.skip(f"no tritonserver: {exc}")


@contextmanager
def serving(src_repo: str | Path, run_dir: str | Path,
            values_per_model: Mapping[str, Mapping[str, object]] | None = None,
            models: list[str] | None = None, **process_kwargs) -> Iterator[TritonProcess]:
    """Render `src_repo` into `run_dir/repo` and run a server on it until the block ends."""
    run_dir = Path(run_dir)
    repo = render_repository(src_repo, run_dir / "repo", values_per_model, models)
    process_kwargs.setdefault("binary", tritonserver_or_skip())
    process_kwargs.setdefault("die_with_parent", True)  # no server outlives a killed test run
    with TritonProcess(repo, workdir=run_dir, **process_kwargs) as server:
        yield server


_SHARED: dict[str, list] = {}  # key -> [server, users]: session fixtures with equal arguments share one server


def server_fixture(src_repo: str | Path, values_per_model: Mapping[str, Mapping[str, object]] | None = None,
                   models: list[str] | None = None, *, scope: str = "session", **process_kwargs):
    """A pytest fixture that yields a running `TritonProcess` (assign it to a module-level name).

    Session-scoped fixtures made with the same arguments, in different test modules, share one server.
    """

    @pytest.fixture(scope=scope)
    def _server(tmp_path_factory) -> Iterator[TritonProcess]:
        key = json.dumps([str(src_repo), values_per_model, models, sorted(process_kwargs.items())],
                         sort_keys=True, default=str)
        if scope == "session" and key in _SHARED:
            entry = _SHARED[key]
            entry[1] += 1
        else:
            run_dir = tmp_path_factory.mktemp("triton")
            context = serving(src_repo, run_dir, values_per_model, models, **process_kwargs)
            entry = [context.__enter__(), 1, context]
            if scope == "session":
                _SHARED[key] = entry
        try:
            yield entry[0]
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                _SHARED.pop(key, None)
                entry[2].__exit__(None, None, None)

    return _server


# -- gRPC streaming -----------------------------------------------------------------------------------

@dataclass
class StreamResponse:
    """One response of a decoupled model: its outputs as numpy arrays, the final flag, or an error."""

    request_id: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    final: bool = False
    error: str | None = None


def grpc_inputs(values: Mapping[str, object]):
    """`tritonclient.grpc.InferInput`s from numpy arrays (str/bytes arrays become BYTES)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in values.items():
        array = np.asarray(value)
        if array.dtype.kind in "USO":
            array = array.astype(object)
            dtype = "BYTES"
        else:
            dtype = np_to_triton_dtype(array.dtype)
        item = grpcclient.InferInput(name, list(array.shape), dtype)
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


class GrpcStream:
    """One gRPC bidirectional stream; many requests may be in flight on it, told apart by request id.

    An error response reaches its request only while that request is the one open on the stream
    (tritonclient does not pass its id on); otherwise any waiting `next()` raises it.
    """

    def __init__(self, url: str, timeout_s: float = 60.0):
        import tritonclient.grpc as grpcclient

        self.timeout_s = timeout_s
        self.client = grpcclient.InferenceServerClient(url)
        self._queues: dict[str, queue.Queue[StreamResponse]] = defaultdict(queue.Queue)
        self._errors: queue.Queue[str] = queue.Queue()
        self._counter = 0
        self._open: set[str] = set()
        self._lock = threading.Lock()
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        if error is not None:
            # tritonclient drops the request id of an error; it is attributed when only one request is open.
            message = error.message() if hasattr(error, "message") else str(error)
            with self._lock:
                open_ids = list(self._open)
                if len(open_ids) == 1:
                    self._open.discard(open_ids[0])
            if len(open_ids) == 1:
                self._queues[open_ids[0]].put(StreamResponse(open_ids[0], final=True, error=message))
            else:
                self._errors.put(message)
            return
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        outputs = {out.name: result.as_numpy(out.name) for out in response.outputs}
        if final:
            with self._lock:
                self._open.discard(response.id)
        self._queues[response.id].put(StreamResponse(response.id, outputs, final))

    def send(self, model: str, values: Mapping[str, object], request_id: str | None = None, **kwargs) -> str:
        """Send one request; returns its id."""
        if request_id is None:
            self._counter += 1
            request_id = f"req-{self._counter}"
        with self._lock:
            self._open.add(request_id)
        self.client.async_stream_infer(model, grpc_inputs(values), request_id=request_id,
                                       enable_empty_final_response=True, **kwargs)
        return request_id

    def next(self, request_id: str, timeout_s: float | None = None) -> StreamResponse:
        """The next response of `request_id` (raises `queue.Empty` past the deadline)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            try:
                return self._queues[request_id].get(timeout=0.2)
            except queue.Empty:
                if not self._errors.empty():
                    raise RuntimeError(f"stream error: {self._errors.get()}") from None
                if time.monotonic() > deadline:
                    raise

    def collect(self, request_id: str, timeout_s: float | None = None) -> list[StreamResponse]:
        """All responses of `request_id` up to and including the final one."""
        responses = []
        while True:
            response = self.next(request_id, timeout_s)
            responses.append(response)
            if response.final:
                return responses

    def infer(self, model: str, values: Mapping[str, object], **kwargs) -> list[StreamResponse]:
        return self.collect(self.send(model, values, **kwargs))

    def close(self, cancel_requests: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel_requests)
        self.client.close()

    def __enter__(self) -> "GrpcStream":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # After a failure a request may still be open: cancel it, or stop_stream would wait for it forever.
        self.close(cancel_requests=exc_type is not None)


# -- metrics ---------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(metrics_url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
        return resp.read().decode("utf-8")


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """`(labels, value)` for every sample of metric `name` in Prometheus text format."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name:
            labels = dict(_LABEL.findall(match.group(2) or ""))
            samples.append((labels, float(match.group(3))))
    return samples


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The sum of `name` over samples whose labels include `labels`; None if there is none."""
    values = [v for lab, v in metric_samples(text, name) if all(lab.get(k) == w for k, w in labels.items())]
    return sum(values) if values else None


def wait_for_metric(metrics_url: str, name: str, predicate, timeout_s: float = 30.0, **labels: str) -> float | None:
    """Scrape until `predicate(value)` holds (value may be None); returns the last value, failing the
    test past the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric_value(scrape(metrics_url), name, **labels)
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"metric {name}{labels or ''} = {value}: condition not met in {timeout_s:.0f} s")
        time.sleep(0.1)
