"""Custom metrics of our Python models (`pb_utils.MetricFamily`) on Triton's metrics port; every one carries the
labels `model` and `instance`. The names and what each counts: docs/operations/metrics.md#every-metric.

Never update a metric outside `_METRIC_LOCK`: python_backend 2.51 crashes tritonserver (SIGSEGV in
`Metric::LoadFromSharedMemory`) when several threads of one stub update metrics at once, and our decoupled
models update them from worker threads. The lock is held only for the IPC call.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LEAD_BUCKETS = (-2.0, -1.0, -0.5, -0.2, -0.1, 0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)  # <= 0: a stall
_METRIC_LOCK = threading.RLock()  # see the module docstring


class _Serialized:
    """A pb_utils Metric whose operations hold the process-wide metric lock."""

    def __init__(self, metric):
        self._metric = metric

    def increment(self, value: float) -> None:
        with _METRIC_LOCK:
            self._metric.increment(value)

    def set(self, value: float) -> None:
        with _METRIC_LOCK:
            self._metric.set(value)

    def observe(self, value: float) -> None:
        with _METRIC_LOCK:
            self._metric.observe(value)

    def value(self) -> float:
        with _METRIC_LOCK:
            return self._metric.value()


@dataclass(frozen=True)
class Spec:
    name: str
    description: str
    kind: str  # "counter" | "gauge" | "histogram"
    buckets: Sequence[float] | None = None
    label_values: Sequence[tuple[str, str]] = ()  # one metric per (label, value); none: one metric


SYNTHESIS = {
    "first_chunk": Spec("cosyvoice_first_chunk_latency_seconds",
                        "Seconds from receiving a synthesis request to sending its first audio chunk",
                        "histogram", LATENCY_BUCKETS),
    "first_audible": Spec("cosyvoice_first_audible_latency_seconds",
                          "Seconds from receiving a synthesis request to sending the chunk that holds its first "
                          "audible sample (a 10 ms window above the model's audible_threshold_dbfs)",
                          "histogram", LATENCY_BUCKETS),
    "lead": Spec("cosyvoice_stream_lead_seconds",
                 "A stream's lead at each chunk sent: audio already sent minus wall time since its first chunk "
                 "(the listener pausing when it runs dry); negative: the chunk ended a stall of that length",
                 "histogram", LEAD_BUCKETS),
    "active": Spec("cosyvoice_active_streams", "Synthesis requests in progress", "gauge"),
    "queued": Spec("cosyvoice_queued_streams", "Synthesis requests admitted and waiting for a worker", "gauge"),
    "slots": Spec("cosyvoice_stream_slots", "Synthesis requests an instance runs at once (its workers)", "gauge"),
    "seconds_per_cost": Spec("cosyvoice_seconds_per_cost",
                             "Measured running seconds per cost unit (cosyvoice_triton/admission.py)", "gauge"),
    "refused": Spec("cosyvoice_admission_refused_total",
                    "Requests refused by admission: at once, or after waiting max_queue_wait_s", "counter"),
    "queue_wait": Spec("cosyvoice_queue_wait_seconds", "Seconds from receiving a synthesis request to a worker "
                       "starting it (its wait in the admission queue)", "histogram", LATENCY_BUCKETS),
    "capacity": Spec("cosyvoice_capacity_audio_seconds_per_second",
                     "Audio seconds this instance makes per wall second, all its streams together (measured; "
                     "before that the cold default; pipeline/capacity.py)", "gauge"),
    "measured": Spec("cosyvoice_capacity_measured", "1 once the capacity is measured, 0 on the cold default",
                     "gauge"),
    "realtime_slots": Spec("cosyvoice_realtime_slots", "Streams this instance keeps ahead of their listeners "
                           "(capacity / realtime margin, at most its workers)", "gauge"),
    "starved": Spec("cosyvoice_starved_streams_total", "Admitted streams whose listener (0.3 s start buffer) "
                    "waited more than 50 ms for audio at least once", "counter"),
    "stall_seconds": Spec("cosyvoice_stall_seconds_total", "Seconds the listeners of starved streams waited, "
                          "summed", "counter"),
    "requests": Spec("cosyvoice_requests_total", "Finished synthesis requests by outcome", "counter",
                     label_values=(("outcome", "ok"), ("outcome", "error"), ("outcome", "cancelled"))),
    "voice_hits": Spec("cosyvoice_voice_store_hits_total", "Voice-store gets answered from the LRU", "counter"),
    "voice_misses": Spec("cosyvoice_voice_store_misses_total", "Voice-store gets of unknown voice ids", "counter"),
    "voice_loads": Spec("cosyvoice_voice_store_loads_total", "Voice-store gets read from the backing store",
                        "counter"),
}

# A split deployment's frontend (cosyvoice2* with token2wav_backends): its view of the backends.
REMOTE_TOKEN2WAV = {
    "backends": Spec("cosyvoice_remote_token2wav_backends", "token2wav backends in this frontend's pool", "gauge"),
    "healthy": Spec("cosyvoice_remote_token2wav_healthy", "token2wav backends taking new streams", "gauge"),
    "streams": Spec("cosyvoice_remote_token2wav_streams", "This frontend's streams pinned to a token2wav backend",
                    "gauge"),
    "failures": Spec("cosyvoice_remote_token2wav_failures_total",
                     "Times a token2wav backend left the pool after a failed call", "counter"),
}

LLM_METRICS = {
    "active": Spec("cosyvoice_llm_active_streams", "LLM streams holding a KV-cache slot", "gauge"),
    "queued": Spec("cosyvoice_llm_queued", "LLM requests waiting for a slot", "gauge"),
    "free_slots": Spec("cosyvoice_llm_free_slots", "Free LLM KV-cache slots", "gauge"),
    "batch": Spec("cosyvoice_llm_batch_size", "Rows of the latest LLM decode step", "gauge"),
    "tps": Spec("cosyvoice_llm_tokens_per_second", "Speech tokens sent per second (last 5 s)", "gauge"),
    "ended": Spec("cosyvoice_llm_streams_total", "Ended LLM streams by reason", "counter",
                  label_values=tuple(("reason", r) for r in ("stop_token", "max_len", "cancelled", "error"))),
    "precision": Spec("cosyvoice_llm_precision_info", "1 for the precision the LLM backbone computes in "
                      "(serve --llm-precision, auto resolved)", "gauge",
                      label_values=tuple(("precision", p) for p in ("fp32", "bf16", "int8", "int8-dynamic"))),
}

TOKEN2WAV_METRICS = {
    "active": Spec("cosyvoice_token2wav_active_streams", "token2wav streams holding state", "gauge"),
    "batch": Spec("cosyvoice_token2wav_batch_size", "Requests (chunks and cancels) per token2wav execute "
                  "(its queue: Triton's nv_inference_pending_request_count of model token2wav)",
                  "histogram", BATCH_BUCKETS),
    "flow_batch": Spec("cosyvoice_token2wav_flow_batch", "Rows of the latest token2wav flow call", "gauge"),
    "freed": Spec("cosyvoice_token2wav_streams_freed_total", "token2wav streams freed by reason", "counter",
                  label_values=tuple(("reason", r) for r in ("finalize", "cancel", "idle"))),
    "precision": Spec("cosyvoice_flow_precision_info", "1 for the precision of the flow estimator (torch: "
                      "serve --flow-precision, auto resolved; graph engines: --precision)", "gauge",
                      label_values=tuple(("precision", p) for p in ("fp32", "bf16", "fp16", "int8-dynamic"))),
}


class ModelMetrics:
    """The metrics of one model instance. `m["active"]` is a metric; `m.labelled("ended", "max_len")`
    one of a labelled family. The families are kept referenced: a metric outlives no family."""

    def __init__(self, pb, specs: Mapping[str, Spec], labels: Mapping[str, str]):
        kinds = {"counter": pb.MetricFamily.COUNTER, "gauge": pb.MetricFamily.GAUGE,
                 "histogram": pb.MetricFamily.HISTOGRAM}
        self._families = {}
        self._metrics: dict[tuple[str, str | None], _Serialized] = {}
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str | None], float] = {}
        with _METRIC_LOCK:
            for key, spec in specs.items():
                family = pb.MetricFamily(name=spec.name, description=spec.description, kind=kinds[spec.kind])
                self._families[key] = family
                buckets = list(spec.buckets) if spec.kind == "histogram" else None
                for label_value in spec.label_values or [None]:
                    own = dict(labels) if label_value is None else {**labels, label_value[0]: label_value[1]}
                    metric = family.Metric(labels=own, buckets=buckets)
                    self._metrics[(key, None if label_value is None else label_value[1])] = _Serialized(metric)

    def __getitem__(self, key: str):
        return self._metrics[(key, None)]

    def labelled(self, key: str, value: str):
        return self._metrics[(key, value)]

    def set_gauges(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Set gauges to `read()`, read under this object's lock: concurrent refreshes cannot leave an
        older reading on top of a newer one."""
        with self._lock:
            for key, value in read().items():
                self._metrics[(key, None)].set(float(value))

    def follow_counter(self, key: str, total: float, value: str | None = None) -> None:
        """Advance a counter to the library's running `total` (its schedulers and pools count; Triton's counters
        only add)."""
        with self._lock:
            last = self._seen.get((key, value), 0.0)
            if total > last:
                self._metrics[(key, value)].increment(float(total - last))
                self._seen[(key, value)] = float(total)


def instance_labels(args: Mapping[str, str]) -> dict[str, str]:
    return {"model": args["model_name"], "instance": args["model_instance_name"]}
