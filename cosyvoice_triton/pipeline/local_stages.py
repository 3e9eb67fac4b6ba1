"""The pipeline's stages in this process: over the serving schedulers (many client threads), and the reference.

`LocalLLMStage` (over a started `LLMScheduler`) and `BatchingToken2WavStage` (over a `Token2WavScheduler`, gathering the
chunks that wait into one scheduler call as Triton's dynamic batcher does for the `token2wav` model) let the
same `Pipeline` that the `cosyvoice2` model drives over BLS run without Triton: the GPU benchmark
(`perf/gpu_bench.py`) measures the serving path this way where no tritonserver is at hand.

`DecodeAheadLLM` and `CoreSharingToken2Wav` overlap the two in one pipeline (the in-process `CosyVoice`):
each LLM stream decodes in a thread of its own, ahead of its consumer, so the next tokens come while
token2wav turns a chunk into audio; both take their torch threads from one `CoreShare` (pipeline/threads.py),
so that together they use the cores and no more. A stream's first chunk, which first audio waits for,
has every core to itself: the LLM's next decode steps wait for it.

`ReferenceLLM` and `ReferenceToken2Wav` run the single-stream code (`llm.generate`, `token2wav.stream`) in the
caller's thread: the reference that the batching stages are checked against.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..llm.bistream import generate_bistream
from ..llm.generate import generate
from ..llm.scheduler import LLMScheduler, LLMStream
from ..messages import ChunkRequest, LLMRequest
from ..token2wav.scheduler import Token2WavScheduler
from .seeds import random_seed
from .stages import TokenStream
from .threads import CoreShare, chunk_unit

CHUNK_TIMEOUT_S = 300.0  # a chunk that waits longer fails its stream instead of hanging the client


class LocalLLMStage:
    """The pipeline's LLMStage over a started `LLMScheduler`: an `LLMStream` is already a TokenStream
    (iterates token lists, `cancel()` frees the slot at the scheduler's next round)."""

    def __init__(self, scheduler: LLMScheduler):
        self.scheduler = scheduler

    def stream(self, request: LLMRequest) -> LLMStream:
        return self.scheduler.submit(request)


@dataclass(frozen=True)
class _Cancel:
    stream_id: str


class BatchingToken2WavStage:
    """The pipeline's Token2WavStage for many client threads. `chunk()` queues the chunk and waits;
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


# ---- one pipeline, the LLM decoding ahead ----------------------------------------------------------

_END = object()  # a decode-ahead stream's last queue item


class DecodeAheadStream:
    """A TokenStream whose tokens are decoded in a thread of its own (one decode step per `running`
    unit of the core share), queued until the consumer takes them."""

    def __init__(self, inner, share: CoreShare):
        self._inner = inner
        self._share = share
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # token lists, then an exception or _END
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._decode, name="llm-decode-ahead", daemon=True)
        self._thread.start()

    def _decode(self) -> None:
        tokens = iter(self._inner)
        try:
            while not self._cancelled.is_set():
                with self._share.running("llm"):
                    new_tokens = next(tokens, _END)
                if new_tokens is _END:
                    break
                self._queue.put(new_tokens)
        except Exception as exc:  # noqa: BLE001 - raised to the consumer, in its thread
            self._queue.put(exc)
        self._queue.put(_END)

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def append_text(self, tokens: list[int], end: bool = False) -> None:
        self._inner.append_text(tokens, end)

    def cancel(self) -> None:
        """Stop decoding; returns once the decode thread has ended (at most one step later), so the next
        stream of this LLM finds its KV cache free."""
        self._cancelled.set()
        self._inner.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join()


class DecodeAheadLLM:
    """LLMStage over another (the reference LLM): each stream decodes ahead, in its own thread."""

    def __init__(self, inner, share: CoreShare):
        self.inner = inner
        self.share = share

    def stream(self, request: LLMRequest) -> DecodeAheadStream:
        return DecodeAheadStream(self.inner.stream(request), self.share)


class CoreSharingToken2Wav:
    """Token2WavStage over another (the reference token2wav): each chunk runs as one `token2wav` unit of
    the core share. A stream's first chunk (the one with its prompt: what first audio waits for) runs
    alone on every core, the LLM's decode steps waiting for it; its middle chunks on token2wav's share of
    the threads (the LLM decodes beside them); its last chunk on every core (the LLM has ended)."""

    def __init__(self, inner, share: CoreShare, first_chunk_alone: bool = True):
        self.inner = inner
        self.share = share
        self.first_chunk_alone = first_chunk_alone  # False: a first chunk as a middle one (benchmarks' before)

    def chunk(self, chunk: ChunkRequest):
        threads, alone = chunk_unit(self.share.plan, [chunk], self.first_chunk_alone)
        with self.share.running("token2wav", threads, alone=alone):
            return self.inner.chunk(chunk)

    @property
    def streams(self):
        """The inner stage's open streams: what a client that left must not leave behind."""
        return self.inner.streams

    def cancel(self, stream_id: str) -> None:
        self.inner.cancel(stream_id)


# ---- the reference stages: the single-stream code, in the caller's thread ------------------------

class GeneratorStream:
    """A TokenStream over a plain token iterator (the reference single-stream LLM loop)."""

    def __init__(self, tokens: Iterable[int]):
        self._tokens = iter(tokens)
        self._cancelled = False

    def __iter__(self) -> Iterator[list[int]]:
        for token in self._tokens:
            if self._cancelled:
                return
            yield [token]

    def cancel(self) -> None:
        self._cancelled = True


class ReferenceBistream(GeneratorStream):
    """A bistream TokenStream over `generate_bistream`, which reads the appended text from a queue."""

    def __init__(self, llm, request: LLMRequest):
        self._pieces: queue.SimpleQueue = queue.SimpleQueue()  # token lists, then None
        self._pieces.put(list(request.text_tokens))
        super().__init__(generate_bistream(llm, iter(self._pieces.get, None), request.prompt_text_tokens,
                                           request.prompt_speech_tokens, request.sampling,
                                           torch.Generator().manual_seed(request.seed)))

    def append_text(self, tokens: list[int], end: bool = False) -> None:
        self._pieces.put(list(tokens))
        if end:
            self._pieces.put(None)

    def cancel(self) -> None:
        super().cancel()
        self._pieces.put(None)  # a generator waiting for text goes on (and stops at its next token)


class ReferenceLLM:
    """LLMStage that runs `llm.generate.generate` (or `bistream.generate_bistream`) in the caller's thread,
    one stream at a time."""

    def __init__(self, llm):
        self.llm = llm

    def stream(self, request: LLMRequest) -> TokenStream:
        if request.bistream:
            return ReferenceBistream(self.llm, request)

        def as_tensor(ids: list[int]) -> torch.Tensor:
            return torch.tensor([ids], dtype=torch.int32).reshape(1, -1)

        tokens = generate(self.llm, as_tensor(request.text_tokens), as_tensor(request.prompt_text_tokens),
                          as_tensor(request.prompt_speech_tokens), request.sampling,
                          torch.Generator().manual_seed(request.seed))
        return GeneratorStream(tokens)


class ReferenceToken2Wav:
    """Token2WavStage over single-stream `Token2WavStream`s, one flow call per chunk."""

    def __init__(self, token2wav):
        self.token2wav = token2wav
        self.streams: dict[str, object] = {}

    def chunk(self, chunk: ChunkRequest) -> np.ndarray:
        state = self.streams.get(chunk.stream_id)
        if state is None:
            seed = chunk.seed if chunk.seed is not None else random_seed()
            state = self.token2wav.stream(chunk.prompt, self.token2wav.noise(seed), speed=chunk.speed)
            self.streams[chunk.stream_id] = state
        audio = state.chunk(chunk.tokens, chunk.finalize)
        if chunk.finalize:
            del self.streams[chunk.stream_id]
        return audio

    def cancel(self, stream_id: str) -> None:
        state = self.streams.pop(stream_id, None)
        if state is not None:
            state.close()
