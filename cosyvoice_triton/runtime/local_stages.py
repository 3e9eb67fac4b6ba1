"""The orchestrator's backends over the serving schedulers in this process, for many client threads.

`LocalLLMStage` (over a started `LLMScheduler`) and `BatchingToken2WavStage` (over a `Token2WavScheduler`, gathering the
chunks that wait into one scheduler call as Triton's dynamic batcher does for the `token2wav` model) let the
same `Orchestrator` that the `cosyvoice2` model drives over BLS run without Triton: the GPU benchmark
(`perf/gpu_bench.py`) measures the serving path this way where no tritonserver is at hand.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from cosyvoice_triton.runtime.llm_scheduler import LLMScheduler, LLMRequest, LLMStream
from cosyvoice_triton.runtime.token2wav_scheduler import ChunkRequest, Token2WavScheduler

CHUNK_TIMEOUT_S = 300.0  # a chunk that waits longer fails its stream instead of hanging the client


class LocalLLMStage:
    """The orchestrator's LLMStage over a started `LLMScheduler`: an `LLMStream` is already a TokenStream
    (iterates token lists, `cancel()` frees the slot at the scheduler's next round)."""

    def __init__(self, scheduler: LLMScheduler):
        self.scheduler = scheduler

    def stream(self, request: LLMRequest) -> LLMStream:
        return self.scheduler.submit(request)


@dataclass(frozen=True)
class _Cancel:
    stream_id: str


class BatchingToken2WavStage:
    """The orchestrator's Token2WavStage for many client threads. `chunk()` queues the chunk and waits;
    one thread takes what is waiting into one `Token2WavScheduler.run`, as Triton's dynamic batcher does for
    the token2wav model: once a request has come it waits up to `queue_delay_s` for more, up to
    `max_batch`. Cancels go through the same thread, since the scheduler takes one caller at a time."""

    def __init__(self, scheduler: Token2WavScheduler, max_batch: int, queue_delay_s: float,
                 chunk_timeout_s: float = CHUNK_TIMEOUT_S):
        self.scheduler = scheduler
        self.max_batch = max_batch
        self.queue_delay_s = queue_delay_s
        self.chunk_timeout_s = chunk_timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (item, Future), or None to stop
        self._thread = threading.Thread(target=self._serve, name="token2wav-batcher", daemon=True)
        self._thread.start()

    def chunk(self, chunk: ChunkRequest):
        return self._call(chunk)

    def cancel(self, stream_id: str) -> None:
        self._call(_Cancel(stream_id))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _call(self, item: ChunkRequest | _Cancel):
        future: Future = Future()
        self._queue.put((item, future))
        return future.result(timeout=self.chunk_timeout_s)

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.queue_delay_s
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            self._run(batch)

    def _run(self, batch: list[tuple[ChunkRequest | _Cancel, Future]]) -> None:
        chunks = [(item, future) for item, future in batch if isinstance(item, ChunkRequest)]
        for item, future in batch:
            if isinstance(item, _Cancel):
                self.scheduler.cancel(item.stream_id)
                future.set_result(None)
        if not chunks:
            return
        try:
            results = self.scheduler.run([chunk for chunk, _ in chunks])
        except Exception as exc:  # noqa: BLE001 - run() answers per chunk; anything else fails its batch
            results = [exc] * len(chunks)
        for (_, future), result in zip(chunks, results):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
