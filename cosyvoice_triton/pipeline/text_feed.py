"""The text of a bistream synthesis as it arrives: pieces handed from the thread that receives them to the
one that reads them (`TextFeed`, by the caller's text_stream_id in `TextFeeds`), and cut before white space
so that the tokens depend on the text, not on how it was cut (`WordPieces`).

Torch-free on purpose: the service's orchestrating Triton models import this and nothing of the LLM.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

from ..errors import Cancelled, InvalidInput

TEXT_IDLE_TIMEOUT_S = 120.0  # a bistream synthesis that gets no text for this long fails (it holds an LLM slot)
WORD_HOLD_CHARS = 24  # a run of text without white space longer than this is tokenized without waiting


class WordPieces:
    """Text arriving in pieces -> text to tokenize, cut before white space, so a word cut across two pieces
    is tokenized whole ("Hel" + "lo world" gives "Hello" then " world"): the tokens depend on the text, not
    on its pieces. The last word waits for the next piece (or the end), unless it is longer than
    WORD_HOLD_CHARS (text without spaces, as Chinese)."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> str:
        self._held += text
        cut = max(self._held.rfind(" "), self._held.rfind("\n"), self._held.rfind("\t"))
        if cut <= 0 and len(self._held) > WORD_HOLD_CHARS:
            cut = len(self._held)
        if cut <= 0:
            return ""
        ready, self._held = self._held[:cut], self._held[cut:]
        return ready

    def flush(self) -> str:
        rest, self._held = self._held, ""
        return rest


_TEXT_END = object()


class TextFeed:
    """The text pieces of one bistream synthesis, from the thread that receives them to the one that reads
    them. Iterating waits for each piece; it ends after `end()`; it raises TimeoutError when no piece comes
    for `idle_timeout_s` (a writer that went quiet must not hold an LLM slot for ever)."""

    def __init__(self, idle_timeout_s: float | None = None):
        self.idle_timeout_s = idle_timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.ended = False
        self.created = time.monotonic()

    def put(self, text: str) -> None:
        if self.ended:
            raise InvalidInput("text_end", "the text of this synthesis has ended")
        self._queue.put(text)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self._queue.put(_TEXT_END)

    def __iter__(self) -> Iterator[str]:
        return self.pieces()

    def pieces(self, is_cancelled: Callable[[], bool] = lambda: False, check_s: float = 0.5) -> Iterator[str]:
        """The pieces as they come; every `check_s` while waiting, Cancelled once `is_cancelled()`."""
        idle_s = 0.0
        while True:
            try:
                item = self._queue.get(timeout=check_s)
            except queue.Empty:
                if is_cancelled():
                    raise Cancelled("the bistream synthesis was cancelled") from None
                idle_s += check_s
                if self.idle_timeout_s is not None and idle_s >= self.idle_timeout_s:
                    raise TimeoutError(f"no text for {self.idle_timeout_s:g} s: the bistream synthesis ends") from None
                continue
            idle_s = 0.0
            if item is _TEXT_END:
                return
            yield item


class TextFeeds:
    """The bistream syntheses of one process by the caller's text_stream_id: `append` hands a piece to the
    synthesis that `open`ed the id. A piece may come before its open (two requests racing): it waits in a
    feed of its own that the open takes over; such a feed is dropped after `unclaimed_s`."""

    def __init__(self, idle_timeout_s: float | None = None, unclaimed_s: float = 60.0):
        self.idle_timeout_s = idle_timeout_s
        self.unclaimed_s = unclaimed_s
        self._feeds: dict[str, TextFeed] = {}
        self._claimed: set[str] = set()
        self._lock = threading.Lock()

    def open(self, stream_id: str) -> TextFeed:
        with self._lock:
            self._drop_unclaimed()
            if stream_id in self._claimed:
                raise InvalidInput("text_stream_id", f"{stream_id!r} is already streaming")
            feed = self._feeds.setdefault(stream_id, TextFeed(self.idle_timeout_s))
            self._claimed.add(stream_id)
            return feed

    def append(self, stream_id: str, text: str, end: bool) -> None:
        with self._lock:
            self._drop_unclaimed()
            feed = self._feeds.setdefault(stream_id, TextFeed(self.idle_timeout_s))
        if text:
            feed.put(text)
        if end:
            feed.end()

    def close(self, stream_id: str) -> None:
        """The synthesis is over: end its feed (a reader still waiting returns) and forget the id."""
        with self._lock:
            feed = self._feeds.pop(stream_id, None)
            self._claimed.discard(stream_id)
        if feed is not None:
            feed.end()

    def __len__(self) -> int:
        with self._lock:
            return len(self._feeds)

    def _drop_unclaimed(self) -> None:
        old = time.monotonic() - self.unclaimed_s
        for stream_id in [s for s, f in self._feeds.items() if s not in self._claimed and f.created < old]:
            del self._feeds[stream_id]
