"""Test-only decoupled model: for `text` and `n`, streams `n` responses, then the final flag.

Response `i` carries `index = [i]` and `chunk` = `len(text)` float32 values equal to `i` (UTF-8 bytes).
It imports `cosyvoice_triton`, so loading at all proves that the stub runs the project's environment,
and exports custom metrics (counter, gauge, histogram) to prove they reach the metrics port.
"""
from __future__ import annotations

import json
import queue
import threading
import traceback
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.errors import InvalidInput

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass(frozen=True)
class EchoParams:
    max_n: int

    @classmethod
    def parse(cls, parameters: dict) -> "EchoParams":
        return cls(max_n=int(parameters["max_n"]["string_value"]))


@dataclass(frozen=True)
class EchoJob:
    text: str
    n: int
    delay_s: float
    sender: object  # pb_utils.InferenceResponseSender


def _scalar(request, name: str, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        if default is None:
            raise InvalidInput(name, "missing")
        return default
    array = tensor.as_numpy()
    if array.size != 1:
        raise InvalidInput(name, f"expected one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.params = EchoParams.parse(config.get("parameters", {}))
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        # Keep the families alive as long as their metrics: a Metric whose MetricFamily was collected fails.
        self.families = {
            "responses": pb_utils.MetricFamily(
                name="echo_stream_responses_total", description="Responses streamed by echo_stream",
                kind=pb_utils.MetricFamily.COUNTER),
            "cancelled": pb_utils.MetricFamily(
                name="echo_stream_cancelled_total", description="echo_stream requests cancelled mid-stream",
                kind=pb_utils.MetricFamily.COUNTER),
            "active": pb_utils.MetricFamily(
                name="echo_stream_active_streams", description="echo_stream requests being streamed",
                kind=pb_utils.MetricFamily.GAUGE),
            "requested_n": pb_utils.MetricFamily(
                name="echo_stream_requested_n", description="n per echo_stream request",
                kind=pb_utils.MetricFamily.HISTOGRAM),
        }
        self.responses = self.families["responses"].Metric(labels=labels)
        self.cancelled = self.families["cancelled"].Metric(labels=labels)
        self.active = self.families["active"].Metric(labels=labels)
        self.requested_n = self.families["requested_n"].Metric(labels=labels, buckets=[1.0, 4.0, 16.0, 64.0])
        self._jobs: queue.Queue[EchoJob | None] = queue.Queue()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._produce, name="echo_stream-producer", daemon=True)
        self._worker.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                n = int(_scalar(request, "n"))
                if not 0 <= n <= self.params.max_n:
                    raise InvalidInput("n", f"must be in [0, {self.params.max_n}], got {n}")
                text = _scalar(request, "text")
                text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
                delay_ms = int(_scalar(request, "delay_ms", default=0))
                if delay_ms < 0:
                    raise InvalidInput("delay_ms", "must be >= 0")
            except InvalidInput as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            self._jobs.put(EchoJob(text=text, n=n, delay_s=delay_ms / 1000.0, sender=sender))
        return None

    def _produce(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._stream(job)

    def _stream(self, job: EchoJob):
        """Send the job's responses; whatever happens, end with exactly one final flag."""
        error = None
        counted = False
        try:
            self.active.increment(1)
            counted = True
            self.requested_n.observe(float(job.n))
            width = len(job.text.encode("utf-8"))
            for i in range(job.n):
                if job.sender.is_cancelled() or self._stop.is_set():
                    self.cancelled.increment(1)
                    error = pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)
                    return
                outputs = [pb_utils.Tensor("chunk", np.full((width,), i, dtype=np.float32)),
                           pb_utils.Tensor("index", np.array([i], dtype=np.int32))]
                job.sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
                self.responses.increment(1)
                if job.delay_s and i + 1 < job.n:
                    self._stop.wait(job.delay_s)
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the producer
            pb_utils.Logger.log_error(f"echo_stream: {traceback.format_exc()}")
            error = pb_utils.TritonError(f"echo_stream failed: {exc}", pb_utils.TritonError.INTERNAL)
        finally:
            try:
                if error is None:
                    job.sender.send(flags=FINAL)
                else:
                    job.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            except Exception:  # noqa: BLE001 - e.g. the client has gone
                pb_utils.Logger.log_warn(f"echo_stream: final flag not sent: {traceback.format_exc()}")
            if counted:
                self.active.increment(-1)

    def finalize(self):
        self._stop.set()
        self._jobs.put(None)
        self._worker.join(timeout=10)
