"""`LLMStream`: the speech tokens of one LLM request, handed from the scheduler thread to one consumer.

The scheduler pushes each sampled token and finishes the stream once (stop token, length limit,
cancellation or error); the consumer reads the tokens in pieces with `get` and sees the end as None (or
the stream's error raised). A bistream stream (`request.bistream`) also takes text the other way:
`append_text` from any thread, which the scheduler reads with `_take_text`. This module holds only those
hand-overs; the scheduler is `llm_scheduler`.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from ..messages import LLMRequest

_END = object()  # the last item of a stream's queue


class LLMStream:
    """The speech tokens of one request, as the scheduler samples them. Read from one consumer thread."""

    def __init__(self, request: LLMRequest, wake: Callable[[], None] = lambda: None):
        """`wake()` tells the scheduler that the stream has news (text, its end, a cancel)."""
        self.request = request
        self.deadline = 0.0  # when its listener runs dry (time.monotonic()): set by the scheduler's submit
        self._wake = wake
        self._text: list[int] = []  # text tokens appended, not yet taken by the scheduler
        self._text_ended = False
        self._end_taken = False  # the scheduler has seen the end of the text
        self.reason: str | None = None  # "stop_token" | "max_len" | "cancelled" | "error", once finished
        self.error: Exception | None = None
        self._cancel = threading.Event()
        self._lock = threading.Lock()  # orders the scheduler's pushes against a finish from stop()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # token ids, then _END

    @property
    def finished(self) -> bool:
        return self.reason is not None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Ask the scheduler to end this stream; it frees the slot and ends the stream at its next round."""
        self._cancel.set()
        self._wake()

    def append_text(self, tokens: list[int], end: bool = False) -> None:
        """Bistream: more text tokens for the live stream; `end`: no more after these. Does nothing once
        the stream has finished. Raises ValueError after the end or on a stream that is not bistream."""
        if not self.request.bistream:
            raise ValueError(f"stream {self.request.stream_id} takes no appended text (not bistream)")
        with self._lock:
            if self._text_ended:
                raise ValueError(f"the text of stream {self.request.stream_id} has ended")
            self._text.extend(int(t) for t in tokens)
            self._text_ended = end
        self._wake()

    @property
    def has_text(self) -> bool:
        """Scheduler side: text (or its end) appended and not yet taken."""
        with self._lock:
            return bool(self._text) or (self._text_ended and not self._end_taken)

    def _take_text(self) -> tuple[list[int], bool]:
        """Scheduler side: (the text tokens appended since the last call, whether the text has ended)."""
        with self._lock:
            tokens, self._text = self._text, []
            self._end_taken = self._text_ended
            return tokens, self._text_ended

    def get(self, timeout: float | None = None) -> list[int] | None:
        """The tokens sampled since the last call (waiting for at least one), or None once the stream has
        ended. Raises the stream's error if it failed, TimeoutError if `timeout` seconds pass first."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no token for request {self.request.stream_id} within {timeout} s") from None
        tokens: list[int] = []
        while item is not _END:  # hand over everything already sampled in one piece
            tokens.append(item)
            if self._queue.empty():
                return tokens
            item = self._queue.get()
        self._queue.put(_END)  # the end stays for later calls
        return tokens or self._end()

    def __iter__(self) -> Iterator[list[int]]:
        while (tokens := self.get()) is not None:
            yield tokens

    def _end(self) -> None:
        if self.error is not None:
            raise self.error
        return None

    def _push(self, token: int) -> None:
        """Scheduler side: deliver one sampled token (dropped once the stream has finished)."""
        with self._lock:
            if not self.finished:
                self._queue.put(token)

    def _finish(self, reason: str, error: Exception | None = None) -> None:
        """Scheduler side: end the stream; the first finish wins, later ones do nothing."""
        with self._lock:
            if self.finished:
                return
            self.error = error
            self.reason = reason  # set last: `finished` implies `error` is final
            self._queue.put(_END)
