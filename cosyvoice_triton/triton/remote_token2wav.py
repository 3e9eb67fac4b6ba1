"""token2wav on other Triton servers: the split deployment's `Token2WavStage` (`RemoteToken2Wav`), over Triton
gRPC. A stream is pinned to the backend that served its first chunk (its state lives there) and never moves; a new
stream goes to the healthy backend with the least outstanding work (`server_pool.ServerPool`); no chunk call waits
longer than `call_timeout_s`, so a hung backend never hangs a client. How backends join, leave and fail:
docs/deployment/index.md#the-split.
"""
from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cosyvoice_triton.errors import ParameterError, RemoteError, Unavailable, Unreachable
from cosyvoice_triton.prometheus_text import metric_sum
from cosyvoice_triton.messages import ChunkRequest
from cosyvoice_triton.server_pool import Server, ServerPool
from cosyvoice_triton.targets import Resolver, TritonTarget, check_spec, discover, is_discovery, resolve_ips
from cosyvoice_triton.wire.stage_tensors import chunk_inputs, token2wav_cancel_inputs
from cosyvoice_triton.wire.outputs import waveform_of
from cosyvoice_triton.wire.names import TOKEN2WAV
from cosyvoice_triton.triton.pb_glue import remote_error

log = logging.getLogger(__name__)

ACTIVE_STREAMS_METRIC = "cosyvoice_token2wav_active_streams"


class Transport:
    """gRPC calls to one backend, on raw protobuf messages (no tritonclient callback threads)."""

    def __init__(self, target: TritonTarget, timeout_s: float):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        from cosyvoice_triton.wire.grpc_messages import CHANNEL_OPTIONS

        self.target = target
        self.timeout_s = timeout_s
        self._grpc = grpc
        self._channel = grpc.insecure_channel(target.grpc, options=CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], request_id: str) -> dict[str, np.ndarray]:
        from cosyvoice_triton.wire.grpc_messages import infer_request, response_outputs

        try:
            response = self._stub.ModelInfer(infer_request(model, inputs, request_id), timeout=self.timeout_s)
        except self._grpc.RpcError as exc:
            raise self._error(exc, model) from None
        return response_outputs(response)

    def _error(self, exc, model: str) -> Exception:
        """Unreachable when the backend did not answer (timed out, or gone): another backend may; else the
        backend's answer as a RemoteError of its kind (`errors.from_wire` reads the gRPC status name)."""
        code = exc.code()
        details = exc.details() or code.name
        if code == self._grpc.StatusCode.DEADLINE_EXCEEDED:
            return Unreachable(f"no answer within {self.timeout_s:g} s")
        if code == self._grpc.StatusCode.UNAVAILABLE and not self.ready(model, timeout_s=2.0):
            return Unreachable(details)  # the server is gone (a busy model answers UNAVAILABLE too)
        return remote_error(model, details, code.name)

    def ready(self, model: str, timeout_s: float) -> bool:
        from tritonclient.grpc import service_pb2

        try:
            return (self._stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=timeout_s).ready and
                    self._stub.ModelReady(service_pb2.ModelReadyRequest(name=model), timeout=timeout_s).ready)
        except self._grpc.RpcError:
            return False

    def active_streams(self, model: str, timeout_s: float) -> float | None:
        """The backend's active-streams gauge of `model`, or None when its metrics cannot be read."""
        try:
            with urllib.request.urlopen(self.target.metrics_url, timeout=timeout_s) as response:
                text = response.read().decode("utf-8", "replace")
        except OSError:
            return None
        return metric_sum(text, ACTIVE_STREAMS_METRIC, model)

    def close(self) -> None:
        self._channel.close()


@dataclass(frozen=True)
class PoolStats:
    backends: int  # in the pool (named, or found in DNS)
    healthy: int  # of those, taking new streams
    open_streams: int  # this frontend's streams pinned to a backend now
    failures: int  # times a backend left the pool after a failed call (running total)


class RemoteToken2Wav:
    """`Token2WavStage` over the token2wav model of backend servers (see the module docstring)."""

    def __init__(self, specs: Sequence[str], model: str = TOKEN2WAV, *, call_timeout_s: float = 60.0,
                 watch_interval_s: float = 2.0,
                 transport_factory: Callable[[TritonTarget, float], Transport] = Transport,
                 resolve: Resolver = resolve_ips, on_change: Callable[[], None] = lambda: None):
        specs = [spec.strip() for spec in specs if spec.strip()]
        if not specs:
            raise ParameterError("no token2wav backends given")
        for spec in specs:
            check_spec(spec, "token2wav_backends")
        self.model = model
        self.specs = specs
        self._new_transport = lambda target: transport_factory(target, call_timeout_s)
        fixed = [TritonTarget.parse(spec, "token2wav_backends") for spec in specs if not is_discovery(spec)]
        # Servers take streams until a call or a probe says otherwise.
        self.pool = ServerPool([Server(t, self._new_transport(t), healthy=True) for t in dict.fromkeys(fixed)],
                               joins_healthy=True)
        self._pins: dict[str, Server] = {}  # stream id -> the backend holding its state
        self._lock = threading.Lock()  # around every use of the pool and the pins
        self._resolve = resolve
        self._failures = 0  # times a backend left the pool after a failed call
        self.on_change = on_change  # called (no lock held) when a backend joins, leaves, fails or recovers
        self._refresh_members()
        self._watch_interval_s = watch_interval_s
        self._stop = threading.Event()
        self._watcher = None
        if watch_interval_s > 0:
            self._watcher = threading.Thread(target=self._watch, name="token2wav-backends", daemon=True)
            self._watcher.start()

    @property
    def backends(self) -> list[Server]:
        """The backends in the pool now; `client` is each one's `Transport`."""
        return self.pool.servers

    @classmethod
    def from_specs(cls, specs: str, model: str = TOKEN2WAV, call_timeout_s: float = 60.0):
        """From a model's `token2wav_backends`: comma-separated `grpc://host:port[?metrics=URL]` or
        `dns://name:port[?metrics_port=N]` (see cosyvoice_triton/targets.py)."""
        log.info("token2wav on %s (split deployment)", specs)
        return cls(specs.split(","), model, call_timeout_s=call_timeout_s)

    # ---- the Token2WavStage interface --------------------------------------------------------------
    def chunk(self, chunk: ChunkRequest) -> np.ndarray:
        inputs = chunk_inputs(chunk)
        with self._lock:
            pinned = self._pins.get(chunk.stream_id)
        if pinned is None:
            if chunk.prompt is None:
                raise Unavailable(f"token2wav stream {chunk.stream_id} has no backend (it was lost)")
            return self._first_chunk(chunk, inputs)
        return self._next_chunk(chunk, inputs, pinned)

    def cancel(self, stream_id: str) -> None:
        """Free the stream's state on its backend (best effort: a dead backend took it with it)."""
        backend = self._unpin(stream_id)
        if backend is None:
            return
        try:
            backend.client.infer(self.model, token2wav_cancel_inputs(stream_id), stream_id)
        except Unreachable as exc:
            self._set_health(backend, False, str(exc))
        except RemoteError as exc:
            log.warning("token2wav %s: cancel of %s failed: %s", backend.name, stream_id, exc)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        with self._lock:
            backends = self.pool.everyone()
            self.pool.servers, self.pool.draining = [], []
        for backend in backends:
            backend.client.close()

    # ---- calls ------------------------------------------------------------------------------------------
    def _first_chunk(self, chunk: ChunkRequest, inputs) -> np.ndarray:
        tried: list[Server] = []
        last_error: Exception | None = None
        while True:
            backend = self._pick_and_pin(chunk.stream_id, exclude=tried)
            if backend is None:
                reason = f": last error {last_error}" if last_error else ""
                raise Unavailable(f"no token2wav backend can take a new stream "
                                  f"({len(tried)} of {len(self.backends)} tried){reason}")
            tried.append(backend)
            try:
                return self._call(backend, chunk, inputs)
            except Unreachable as exc:
                self._unpin(chunk.stream_id)
                self._set_health(backend, False, str(exc))
                last_error = exc
            except RemoteError as exc:
                if not isinstance(exc.error, Unavailable):
                    raise  # a bad request fails the same way everywhere; the caller cancels the pin
                self._unpin(chunk.stream_id)  # full (stream limit): another backend may have room
                last_error = exc

    def _next_chunk(self, chunk: ChunkRequest, inputs, backend: Server) -> np.ndarray:
        try:
            return self._call(backend, chunk, inputs)
        except Unreachable as exc:
            self._unpin(chunk.stream_id)
            self._set_health(backend, False, str(exc))
            raise Unavailable(f"token2wav backend {backend.name} went away mid-stream ({exc}); "
                              "the stream's state was there") from None

    def _call(self, backend: Server, chunk: ChunkRequest, inputs) -> np.ndarray:
        outputs = backend.client.infer(self.model, inputs, chunk.stream_id)
        if chunk.finalize:
            self._unpin(chunk.stream_id)  # the backend freed the state with the final chunk
        return waveform_of(outputs)

    # ---- the pool ----------------------------------------------------------------------------------------
    def _pick_and_pin(self, stream_id: str, exclude: Sequence[Server]) -> Server | None:
        with self._lock:
            chosen = self.pool.pick(exclude)
            if chosen is not None:
                self.pool.acquire(chosen)
                self._pins[stream_id] = chosen
            return chosen

    def _unpin(self, stream_id: str) -> Server | None:
        with self._lock:
            backend = self._pins.pop(stream_id, None)
            idle = backend is not None and self.pool.release(backend)
        if idle:
            backend.client.close()  # it left DNS and its last stream just ended
        return backend

    def _refresh_members(self) -> None:
        """Follow DNS: new addresses join the pool; vanished ones take no new stream and are closed once
        their streams are done. A `dns://` spec that resolves to nothing keeps what it had (a DNS hiccup
        must not empty the pool)."""
        found = {spec: discover([spec], "token2wav_backends", self._resolve)
                 for spec in self.specs if is_discovery(spec)}
        changed, closing = False, []
        with self._lock:
            for spec, targets in found.items():
                if not targets:
                    log.warning("token2wav backends: %s resolved to nothing; keeping those known", spec)
                update = self.pool.update(spec, targets, self._new_transport)
                for backend in update.joined:
                    log.info("token2wav backend %s joined the pool", backend.name)
                for backend in update.left:
                    log.warning("token2wav backend %s left DNS: no new streams there", backend.name)
                changed = changed or bool(update.joined or update.left)
                closing += update.idle
        for backend in closing:
            backend.client.close()
        if changed:
            self.on_change()

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(backends=len(self.pool.servers), healthy=len(self.pool.healthy()),
                             open_streams=len(self._pins), failures=self._failures)

    def pinned(self) -> dict[str, str]:
        """Stream id -> backend name, for the streams open now."""
        with self._lock:
            return {stream_id: backend.name for stream_id, backend in self._pins.items()}

    def _set_health(self, backend: Server, healthy: bool, reason: str = "") -> None:
        with self._lock:
            if not self.pool.set_health(backend, healthy):  # forgets its scraped count: stale either way
                return
            self._failures += not healthy
        if healthy:
            log.warning("token2wav backend %s is ready: back in the pool", backend.name)
        else:
            log.warning("token2wav backend %s left the pool: %s", backend.name, reason)
        self.on_change()

    def _watch(self) -> None:
        """Follow DNS; probe the backends that left the pool; refresh every backend's count of other
        frontends' streams."""
        follow_dns = any(is_discovery(spec) for spec in self.specs)
        while not self._stop.wait(self._watch_interval_s):
            if follow_dns:
                self._refresh_members()
            with self._lock:
                backends = list(self.pool.servers)
            for backend in backends:
                if not backend.healthy:
                    if backend.client.ready(self.model, timeout_s=self._watch_interval_s):
                        self._set_health(backend, True)
                    continue
                active = backend.client.active_streams(self.model, timeout_s=self._watch_interval_s)
                if active is not None:
                    with self._lock:
                        self.pool.set_external(backend, active)
