"""Serving a decoupled model's requests from worker threads, so that `execute` returns at once.

A decoupled model whose requests make blocking BLS calls must not make them in `execute`: the
instance would take no new request (or cancellation) meanwhile, and a BLS call back into a model
waiting on this instance would deadlock. `RequestPool` runs each request in a thread of a bounded pool;
`send_chunks` sends one request's audio chunks as they come, checks cancellation between chunks,
observes the stream's lead at every chunk (`cosyvoice_stream_lead_seconds`), and always ends with
exactly one final flag; `send_whole` sends them as one waveform in one final response
(a non-decoupled model may answer through its response sender too).
"""
from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cosyvoice_triton.audio_out import SAMPLE_RATE
from cosyvoice_triton.errors import Cancelled
from cosyvoice_triton.runtime.playback import Playback
from cosyvoice_triton.triton.tensors import classify, error_response


class RequestPool:
    """At most `max_workers` requests run at once and `max_pending` more wait; `try_submit` refuses
    beyond that (the caller answers UNAVAILABLE)."""

    def __init__(self, max_workers: int, max_pending: int, name: str):
        if max_workers < 1 or max_pending < 0:
            raise ValueError(f"max_workers ({max_workers}) must be >= 1 and max_pending ({max_pending}) >= 0")
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
        self._capacity = threading.BoundedSemaphore(max_workers + max_pending)
        self.stopping = threading.Event()

    def try_submit(self, job: Callable[[], None]) -> bool:
        if self.stopping.is_set() or not self._capacity.acquire(blocking=False):
            return False

        def run() -> None:
            try:
                job()
            finally:
                self._capacity.release()

        self._executor.submit(run)
        return True

    def close(self) -> None:
        """Stop taking requests, tell running ones to stop (`stopping`), wait for them."""
        self.stopping.set()
        self._executor.shutdown(wait=True, cancel_futures=True)


def send_chunks(pb, sender, chunks: Callable[[], Iterator[np.ndarray]], *, model: str, received_at: float,
                metrics=None, is_cancelled: Callable[[], bool] | None = None) -> str:
    """Send every non-empty chunk as a `waveform` response, then the final flag (with the error, if one
    ended the request). Returns the outcome: "ok", "error" or "cancelled"."""
    final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    cancelled = is_cancelled or sender.is_cancelled
    error: BaseException | None = None
    playback = Playback()  # the listener's side of this stream: its lead at every chunk
    if metrics is not None:
        metrics["active"].increment(1)
    try:
        first = True
        with contextlib.closing(chunks()) as produced:  # closing runs the producer's cleanup (cancels)
            for chunk in produced:
                if cancelled():
                    raise Cancelled("the client cancelled the request")
                if chunk.size == 0:
                    continue
                waveform = np.ascontiguousarray(chunk, dtype=np.float32).reshape(-1)
                sender.send(pb.InferenceResponse(output_tensors=[pb.Tensor("waveform", waveform)]))
                sent_at = time.monotonic()
                lead = playback.add(sent_at, waveform.size / SAMPLE_RATE)
                if metrics is not None:
                    if first:
                        metrics["first_chunk"].observe(sent_at - received_at)
                    metrics["lead"].observe(lead)
                first = False
    except BaseException as exc:  # noqa: BLE001 - every failure ends this request, never the instance
        error = exc
    outcome = "ok" if error is None else ("cancelled" if classify(error).code_name == "CANCELLED" else "error")
    _count_outcome(metrics, outcome)  # before the final flag: a client that has its answer sees it counted
    try:
        if error is None:
            sender.send(flags=final)
        else:
            sender.send(error_response(pb, error, model), flags=final)
    except Exception:  # noqa: BLE001 - e.g. the client has gone
        pb.Logger.log_warn(f"{model}: final response not sent: {traceback.format_exc()}")
    return outcome


def send_whole(pb, sender, chunks: Callable[[], Iterator[np.ndarray]], *, model: str, received_at: float,
               metrics=None, is_cancelled: Callable[[], bool] | None = None) -> str:
    """Collect every chunk, then send the whole `waveform` (or the error) in one final response.
    Returns the outcome: "ok", "error" or "cancelled"."""
    final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    cancelled = is_cancelled or sender.is_cancelled
    if metrics is not None:
        metrics["active"].increment(1)
    response = None
    outcome = "ok"
    try:
        pieces = []
        with contextlib.closing(chunks()) as produced:
            for chunk in produced:
                if cancelled():
                    raise Cancelled("the client cancelled the request")
                if chunk.size and not pieces and metrics is not None:
                    metrics["first_chunk"].observe(time.monotonic() - received_at)
                pieces.append(np.asarray(chunk, dtype=np.float32).reshape(-1))
        waveform = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
        response = pb.InferenceResponse(output_tensors=[pb.Tensor("waveform", waveform)])
    except BaseException as exc:  # noqa: BLE001 - every failure ends this request, never the instance
        outcome = "cancelled" if classify(exc).code_name == "CANCELLED" else "error"
        response = error_response(pb, exc, model)
    _count_outcome(metrics, outcome)
    try:
        sender.send(response, flags=final)
    except Exception:  # noqa: BLE001 - e.g. the client has gone
        pb.Logger.log_warn(f"{model}: response not sent: {traceback.format_exc()}")
    return outcome


def _count_outcome(metrics, outcome: str) -> None:
    """The request leaves `active` and joins its outcome's count. Called before the final response is
    sent, so that a client which has its answer never reads a counter that does not include it yet."""
    if metrics is not None:
        metrics["active"].increment(-1)
        metrics.labelled("requests", outcome).increment(1)
