"""Serving a decoupled model's requests from worker threads, so that `execute` returns at once.

A decoupled model whose requests make blocking BLS calls must not make them in `execute`: the
instance would take no new request (or cancellation) meanwhile, and a BLS call back into a model
waiting on this instance would deadlock. `RequestPool` runs each request in a thread of a bounded pool
(admitted by cosyvoice_triton/admission.py's policy);
`send_chunks` sends one request's audio chunks as they come, checks cancellation between chunks,
observes the stream's lead at every chunk (`cosyvoice_stream_lead_seconds`) and its first audible audio
(`cosyvoice_first_audible_latency_seconds`, pipeline/audible.py), and always ends with exactly one final flag; `send_whole` sends them as one waveform in one final response
(a non-decoupled model may answer through its response sender too).
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from cosyvoice_triton.admission import MEAN_COST, AdmissionPolicy, Decision, Load, SpeedMeter, expiry
from cosyvoice_triton.audio_out import SAMPLE_RATE
from cosyvoice_triton.errors import Cancelled, ParameterError, Unavailable
from cosyvoice_triton.pipeline.audible import DEFAULT_THRESHOLD_DBFS, AudibleDetector
from cosyvoice_triton.pipeline.capacity import Capacity
from cosyvoice_triton.pipeline.playback import Playback
from cosyvoice_triton.pipeline.speech_marks import complete_marks, is_mark_event
from cosyvoice_triton.wire.outputs import marks_outputs, waveform_outputs
from cosyvoice_triton.triton.pb_glue import classify, error_response, output_tensors


class RequestPool:
    """At most `max_workers` requests run at once; more wait, first come first served, while the admission
    policy (cosyvoice_triton/admission.py) expects them to start within `max_wait_s` and fewer than
    `max_pending` wait. `admit` refuses beyond that at once; a waiting request that has not started after
    `max_wait_s` is refused then (`on_expired`), so no request waits longer than that for a worker.

    With a `capacity` (streamed requests: admission in real-time units, pipeline/capacity.py) the requests
    that run at once are also at most its real-time slots, and none starts while a running stream's
    listener waits for audio: the head of the queue starts when a stream ends or the streams catch up.

    A request leaves `running` when it ends (`finish`, which the job calls before its final response: a
    client that has its answer and sends the next request at once finds the slot free), and a waiting
    request whose client has cancelled counts for nothing (it ends as soon as a worker takes it).

    `waiting` / `running` / `refused` are the counts that the model's metrics follow."""

    def __init__(self, max_workers: int, max_pending: int, name: str,
                 policy: AdmissionPolicy = AdmissionPolicy(), capacity: Capacity | None = None):
        if max_workers < 1 or max_pending < 0:
            raise ParameterError(f"max_workers ({max_workers}) must be >= 1 and max_pending ({max_pending}) >= 0")
        self.name = name
        self.max_workers = max_workers
        self.max_pending = max_pending
        self.policy = policy
        self.speed = SpeedMeter()
        self.capacity = capacity
        if capacity is not None:
            capacity.on_change = self._notify  # a stream opened, made audio or closed: the head may start
        self.stopping = threading.Event()
        self.running = 0
        self.refused = 0  # requests refused (at once or after waiting), since the start
        self._queue: deque[_Waiting] = deque()
        self._changed = threading.Condition()
        self._current = threading.local()  # .item: the request this worker thread runs, until it finishes
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max_workers)]
        self._threads.append(threading.Thread(target=self._expire, name=f"{name}-expiry", daemon=True))
        for thread in self._threads:
            thread.start()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def load(self) -> Load:
        """What admission reads: the running requests and the waiting ones whose client is still there."""
        live = [item for item in self._queue if not item.cancelled()]
        return Load(capacity=self.slots(), streams=self.running + len(live),
                    queued_cost=sum(item.cost for item in live),
                    seconds_per_cost=self.speed.seconds_per_cost, mean_cost=self.speed.mean_cost)

    def slots(self) -> int:
        """Requests that may run at once now: the workers, or fewer real-time slots; while a listener waits
        for audio, no more than run now."""
        if self.capacity is None:
            return self.max_workers
        slots = self.capacity.slots(self.max_workers)
        return max(1, min(slots, self.running)) if self.capacity.stalled() else slots

    def _may_start(self) -> bool:
        return self.running < self.slots()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def admit(self, job: Callable[[], None], cost: float = MEAN_COST,
              on_expired: Callable[[Unavailable], None] | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> Decision:
        """Queue `job` (run by a worker) or refuse it: the decision says which, and the wait estimated.
        `on_expired(error)` answers a job refused after waiting `max_wait_s` (it never runs then);
        `cancelled()` says whether its client has gone (it then counts for nothing while it waits)."""
        with self._changed:
            if self.stopping.is_set():
                self.refused += 1
                return Decision(False, math.inf, 1)
            load = self.load()
            decision = self.policy.decide(load)
            if decision.admit and load.streams >= self.max_workers + self.max_pending:
                decision = Decision(False, max(decision.wait_s, self.policy.max_wait_s), 1)  # max_pending
            if not decision.admit:
                self.refused += 1
                return decision
            self._queue.append(_Waiting(job, cost, time.monotonic(), on_expired, cancelled))
            self._changed.notify_all()
            return decision

    def try_submit(self, job: Callable[[], None], cost: float = MEAN_COST) -> bool:
        return self.admit(job, cost).admit

    def _work(self) -> None:
        while True:
            with self._changed:
                while not (self._queue and self._may_start()) and not self.stopping.is_set():
                    self._changed.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self.running += 1
            item.started = time.monotonic()
            self._current.item = item
            try:
                item.job()
            except BaseException:  # noqa: BLE001 - a job answers its own errors; the worker lives on
                traceback.print_exc()
            finally:
                self.finish()

    def finish(self) -> None:
        """The calling worker's request has ended: its slot is free now and its running time measured. A job
        calls it before its final response (`send_chunks(on_end=...)`); else the worker does when the job
        returns. Once per request; a call from another thread does nothing."""
        item = getattr(self._current, "item", None)
        if item is None:
            return
        self._current.item = None
        self.speed.add(item.cost, time.monotonic() - item.started)
        with self._changed:
            self.running -= 1
            self._changed.notify_all()

    def _expire(self) -> None:
        """Refuse waiting jobs older than `max_wait_s` (a timed wait on the queue's condition, no polling)."""
        limit = self.policy.max_wait_s
        while True:
            expired = []
            with self._changed:
                if self.stopping.is_set():
                    return
                now = time.monotonic()
                while self._queue and now - self._queue[0].queued_at > limit:
                    expired.append((self._queue.popleft(), now))
                    self.refused += 1
                timeout = limit - (now - self._queue[0].queued_at) if self._queue else None
                if not expired:
                    self._changed.wait(timeout)
            for item, now in expired:
                if item.on_expired is not None:
                    item.on_expired(expiry(self.name, now - item.queued_at))

    def close(self) -> None:
        """Stop taking requests, tell running ones to stop (`stopping`), refuse the waiting ones, wait for
        the running ones."""
        with self._changed:
            self.stopping.set()
            dropped = list(self._queue)
            self._queue.clear()
            self._changed.notify_all()
        for item in dropped:
            if item.on_expired is not None:
                item.on_expired(Unavailable(f"{self.name} is shutting down"))
        for thread in self._threads:
            thread.join()


@dataclass(eq=False)
class _Waiting:
    job: Callable[[], None]
    cost: float
    queued_at: float
    on_expired: Callable[[Unavailable], None] | None
    cancelled: Callable[[], bool] = lambda: False
    started: float = 0.0  # when a worker took it


def send_chunks(pb, sender, chunks: Callable[[], Iterator[np.ndarray]], *, model: str, received_at: float,
                metrics=None, is_cancelled: Callable[[], bool] | None = None, batched: bool = False,
                audible_threshold_dbfs: float = DEFAULT_THRESHOLD_DBFS,
                on_end: Callable[[], None] = lambda: None) -> str:
    """Send every non-empty chunk as a `waveform` response ([1, n] when `batched`: a model with
    max_batch_size > 0), then the final flag (with the error, if one ended the request); `on_end()` runs just
    before the final flag (the request pool's `finish`: the slot is free when the client hears the end). Returns the outcome:
    "ok", "error" or "cancelled". Speech mark events among the chunks (pipeline/speech_marks.py) go in `marks`
    with the next chunk's response, those after the last chunk in a response of their own."""
    final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    cancelled = is_cancelled or sender.is_cancelled
    error: BaseException | None = None
    playback = Playback()  # the listener's side of this stream: its lead at every chunk
    audible = AudibleDetector(SAMPLE_RATE, audible_threshold_dbfs)
    if metrics is not None:
        metrics["active"].increment(1)
    try:
        first = True
        with contextlib.closing(_audio_and_marks(chunks, cancelled)) as produced:  # closed at once on failure
            for chunk, marks in produced:
                outputs = waveform_outputs(chunk, batched) if chunk is not None else {}
                if marks:
                    outputs.update(marks_outputs(marks, batched))
                sender.send(pb.InferenceResponse(output_tensors=output_tensors(pb, outputs)))
                if chunk is None:  # the last sentence's mark_end: after its audio, alone
                    continue
                sent_at = time.monotonic()
                lead = playback.add(sent_at, chunk.size / SAMPLE_RATE)
                if metrics is not None:
                    if first:
                        metrics["first_chunk"].observe(sent_at - received_at)
                    metrics["lead"].observe(lead)
                first = False
                _observe_audible(metrics, audible.feed(chunk, sent_at), audible, received_at)
        _observe_audible(metrics, audible.finish(), audible, received_at)
    except BaseException as exc:  # noqa: BLE001 - every failure ends this request, never the instance
        error = exc
    outcome = "ok" if error is None else ("cancelled" if classify(error).code_name == "CANCELLED" else "error")
    _count_outcome(metrics, outcome)  # before the final flag: a client that has its answer sees it counted
    on_end()
    try:
        if error is None:
            sender.send(flags=final)
        else:
            sender.send(error_response(pb, error, model), flags=final)
    except Exception:  # noqa: BLE001 - e.g. the client has gone
        pb.Logger.log_warn(f"{model}: final response not sent: {traceback.format_exc()}")
    return outcome


def send_whole(pb, sender, chunks: Callable[[], Iterator[np.ndarray]], *, model: str, received_at: float,
               metrics=None, is_cancelled: Callable[[], bool] | None = None, batched: bool = False,
               audible_threshold_dbfs: float = DEFAULT_THRESHOLD_DBFS,
               on_end: Callable[[], None] = lambda: None) -> str:
    """Collect every chunk, then send the whole `waveform` ([1, n] when `batched`) or the error in one final
    response (`on_end()` just before it, as in `send_chunks`). Returns the outcome: "ok", "error" or "cancelled". Its first chunk and first audible audio
    are timed when they are made, as the streamed model's (the client has them only with the whole). Speech mark
    events among the chunks go with it in `marks`, as the complete marks (pipeline/speech_marks.py)."""
    final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    cancelled = is_cancelled or sender.is_cancelled
    if metrics is not None:
        metrics["active"].increment(1)
    response = None
    outcome = "ok"
    audible = AudibleDetector(SAMPLE_RATE, audible_threshold_dbfs)
    try:
        pieces, marks = [], []
        with contextlib.closing(_audio_and_marks(chunks, cancelled)) as produced:
            for chunk, more in produced:
                marks += more
                if chunk is None:
                    continue
                if not pieces and metrics is not None:
                    metrics["first_chunk"].observe(time.monotonic() - received_at)
                pieces.append(np.asarray(chunk, dtype=np.float32).reshape(-1))
                _observe_audible(metrics, audible.feed(pieces[-1], time.monotonic()), audible, received_at)
        _observe_audible(metrics, audible.finish(), audible, received_at)
        waveform = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
        outputs = waveform_outputs(waveform, batched)
        if marks:
            outputs.update(marks_outputs(complete_marks(marks), batched))
        response = pb.InferenceResponse(output_tensors=output_tensors(pb, outputs))
    except BaseException as exc:  # noqa: BLE001 - every failure ends this request, never the instance
        outcome = "cancelled" if classify(exc).code_name == "CANCELLED" else "error"
        response = error_response(pb, exc, model)
    _count_outcome(metrics, outcome)
    on_end()
    try:
        sender.send(response, flags=final)
    except Exception:  # noqa: BLE001 - e.g. the client has gone
        pb.Logger.log_warn(f"{model}: response not sent: {traceback.format_exc()}")
    return outcome


def _audio_and_marks(chunks: Callable[[], Iterator[np.ndarray]], cancelled: Callable[[], bool]
                     ) -> Iterator[tuple[np.ndarray | None, list[dict]]]:
    """Each non-empty audio chunk with the speech mark events (pipeline/speech_marks.py) made just before it,
    then (None, the events after the last chunk) if there are any. Raises `Cancelled` as soon as the client
    cancels; closing the producer runs its cleanup (it cancels its work)."""
    marks: list[dict] = []
    with contextlib.closing(chunks()) as produced:
        for chunk in produced:
            if cancelled():
                raise Cancelled("the client cancelled the request")
            if is_mark_event(chunk):
                marks.append(chunk.to_json())
            elif chunk.size:
                yield chunk, marks
                marks = []
    if marks:
        yield None, marks


def _observe_audible(metrics, found: bool, audible: AudibleDetector, received_at: float) -> None:
    """`found`: the detector has just found the stream's first audible sample: observe when its chunk went."""
    if found and metrics is not None:
        metrics["first_audible"].observe(audible.at - received_at)


def _count_outcome(metrics, outcome: str) -> None:
    """The request leaves `active` and joins its outcome's count. Called before the final response is
    sent, so that a client which has its answer never reads a counter that does not include it yet."""
    if metrics is not None:
        metrics["active"].increment(-1)
        metrics.labelled("requests", outcome).increment(1)
