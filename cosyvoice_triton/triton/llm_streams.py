"""Forwarding the LLM scheduler's streams to their clients: the decoupled `llm` model's streaming loop.

`execute` only parses and calls `open`; the scheduler thread decodes every live stream together, and
one forwarding job per stream (a bounded pool; each blocks on its own stream's queue) hands the
stream's tokens to its `TokenSender` as they are sampled and ends it with exactly one final send
(`send_final`, or `send_error` for a failed stream). A cancel request (`cancel`), the client going
away (`is_cancelled`), or `stop` cancels the scheduler stream, which frees its slot at the next round;
the job keeps draining until the scheduler ends the stream, so the slot is free when the final is sent.
A text_append request (`append_text`) hands more text to a bistream stream.

No Triton types here: the model file adapts a response sender to `TokenSender`, so this loop is
tested with a plain fake sender (tests/test_llm_streams.py).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import LLMRequest
from cosyvoice_triton.llm.scheduler import LLMScheduler
from cosyvoice_triton.llm.stream import LLMStream
from cosyvoice_triton.wire.names import STREAM_ID

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.5  # a stream still waiting for a slot (or a token) looks at its client this often


class TokenSender(Protocol):
    """Where one stream's tokens go: a decoupled model's response sender, adapted."""

    def send_tokens(self, tokens: list[int]) -> None:
        """One response with these speech tokens (never empty)."""

    def send_final(self) -> None:
        """The stream ended normally: the final flag, no data."""

    def send_error(self, error: Exception) -> None:
        """The stream failed: its error, with the final flag."""

    def is_cancelled(self) -> bool:
        """True once the client has gone away or cancelled."""


class LLMStreamForwarder:
    """The live streams of one scheduler by stream_id, each forwarded to its sender by a job of its own.

    Owns the scheduler's lifecycle from `start` to `stop`. `on_tokens()` runs after each send of tokens and
    `on_end(reason)` after each final send (metrics), both on the forwarding job's thread."""

    def __init__(self, scheduler: LLMScheduler, on_tokens: Callable[[], None] = lambda: None,
                 on_end: Callable[[str], None] = lambda reason: None, cancel_check_s: float = CANCEL_CHECK_S):
        self.scheduler = scheduler
        self._on_tokens = on_tokens
        self._on_end = on_end
        self._cancel_check_s = cancel_check_s
        self._streams: dict[str, LLMStream] = {}  # stream_id -> stream, from open until its final send
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # One job per stream that holds a slot or waits for one; the scheduler refuses the rest.
        self._jobs = ThreadPoolExecutor(max_workers=scheduler.max_batch + scheduler.max_queue,
                                        thread_name_prefix="llm-forward")

    def start(self) -> None:
        self.scheduler.start()

    def open(self, request: LLMRequest, sender: TokenSender) -> None:
        """Submit the request and forward its stream to `sender`. Raises InvalidInput for a stream_id
        that is still streaming (or a bad field), SchedulerUnavailable when the scheduler takes no more;
        nothing is sent to `sender` then."""
        with self._lock:
            if request.stream_id in self._streams:
                raise InvalidInput(STREAM_ID, f"{request.stream_id!r} is already streaming")
            stream = self.scheduler.submit(request)
            self._streams[request.stream_id] = stream
        self._jobs.submit(self._forward, stream, sender)

    def append_text(self, stream_id: str, tokens: list[int], end: bool) -> bool:
        """More text for bistream stream `stream_id`; False when none is streaming (it has ended: the text
        is dropped). Raises ValueError for a stream that is not bistream or whose text has ended."""
        with self._lock:
            stream = self._streams.get(stream_id)
        if stream is not None:
            stream.append_text(tokens, end)
        return stream is not None

    def cancel(self, stream_id: str) -> bool:
        """Cancel the stream of this id; False when none is streaming (already ended, or unknown)."""
        with self._lock:
            stream = self._streams.get(stream_id)
        if stream is not None:
            stream.cancel()
        return stream is not None

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def stop(self) -> None:
        """Stop the scheduler (it fails every open stream, so each ends with one final error) and wait for
        every forwarding job to send its final."""
        self._stopping.set()
        self.scheduler.stop()
        self._jobs.shutdown(wait=True)

    def _forward(self, stream: LLMStream, sender: TokenSender) -> None:
        """Send the stream's tokens as they come; end with exactly one final send."""
        error = None
        try:
            self._send_tokens(stream, sender)
        except Exception as exc:  # noqa: BLE001 - the stream's error, or a send that failed
            error = exc
            stream.cancel()  # a send that failed leaves nobody to read the stream: free its slot
        finally:
            with self._lock:
                self._streams.pop(stream.request.stream_id, None)
            self._send_final(stream, sender, error)
            self._on_end(stream.reason or "error")

    def _send_tokens(self, stream: LLMStream, sender: TokenSender) -> None:
        while True:
            try:
                tokens = stream.get(timeout=self._cancel_check_s)
            except TimeoutError:
                tokens = []
            if tokens is None:
                return
            if sender.is_cancelled() or self._stopping.is_set():
                stream.cancel()  # the scheduler ends the stream at its next round; keep draining
                continue
            if tokens:
                sender.send_tokens(tokens)
                self._on_tokens()

    @staticmethod
    def _send_final(stream: LLMStream, sender: TokenSender, error: Exception | None) -> None:
        try:
            if error is None:
                sender.send_final()
            else:
                sender.send_error(error)
        except Exception as exc:  # noqa: BLE001 - e.g. the client has gone
            log.warning("final response of %s not sent: %s", stream.request.stream_id, exc)
