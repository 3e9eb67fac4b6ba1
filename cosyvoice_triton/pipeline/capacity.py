"""A server's capacity in real-time units, and its listeners' stalls: what admission of streams reads.

**Capacity** is the audio a server makes per wall second, all its streams together, for the mix it runs
now (model size, engine, batching: whatever it is, it shows in the figure). `Capacity.watch` follows each
stream's chunks as they are made; while at least one stream is open, the audio made and the busy wall
time are summed with an exponential forgetting over `window_s` busy seconds (idle time ages nothing: the
machine's speed does not change while it waits), and the estimate is their ratio. Before
`measured_after_s` busy seconds (a cold server) the estimate is `default` (COLD_STREAMS streams at the
margin); `forced` replaces it altogether (`serve --capacity`: a known figure, or tests).

The figure measured with n streams open is a lower bound of what n + 1 would get in all (batching only
adds), so "n + 1 streams at the measured capacity" is a conservative prediction: the estimate grows as
the load grows and the batches fill, and stops where the streams would fall behind.

**Real-time slots**: the streams the server keeps ahead of their listeners, floor(capacity / margin),
at least 1 (a server always runs one stream, even a slow one) and at most its workers; floor(capacity)
(margin 1) while every running stream's listener holds BUFFERED_MARGIN_S of audio or more (the margin is
in their buffers, and the server gets to measure what one more stream makes). A new stream
starts while fewer streams run and no running stream's listener is waiting right now (`stalled`); else it
waits in the queue (cosyvoice_triton/admission.py prices the wait). `margin` 0 turns this off: the slots
are the workers (cost-based admission only).

**Starvation**: each watched stream has a listener (pipeline/playback.py `Playback`) that starts
LISTENER_START_BUFFER_S after the first chunk; a chunk that comes more than STALL_TOLERANCE_S after the
listener ran dry is a stall. `starved` counts the streams that stalled at least once, `stall_s` sums
their stalls: with admission in real-time units both stay 0 (the alert rule in deploy/ fires otherwise).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from .playback import Playback

DEFAULT_REALTIME_MARGIN = 1.2  # serve / up --realtime-margin: every stream gets audio 1.2x faster than real time
COLD_STREAMS = 2  # before measurements a server is assumed to keep this many streams ahead at the margin
MEASURED_AFTER_S = 2.0  # busy seconds of streams before the measurement replaces the default
CAPACITY_WINDOW_S = 30.0  # busy seconds that the estimate averages over (exponential forgetting)
LISTENER_START_BUFFER_S = 0.3  # the listener rule: playback starts this long after the first chunk
STALL_TOLERANCE_S = 0.05  # a listener that waits less than this has not noticed
BUFFERED_MARGIN_S = 2.0  # listeners holding this much audio carry the margin themselves (Capacity.slots)


def realtime_slots(capacity: float, margin: float, max_streams: int) -> int:
    """Streams kept ahead of their listeners: floor(capacity / margin), within [1, max_streams]; margin 0:
    max_streams (real-time admission off)."""
    if margin <= 0:
        return max_streams
    return max(1, min(max_streams, math.floor(capacity / margin + 1e-9)))


class Capacity:
    """One server's (one model instance's) capacity, listeners and stalls (thread-safe); see the module
    docstring. `on_change()` is called, outside any lock, when a stream opens, makes audio or closes."""

    def __init__(self, margin: float = DEFAULT_REALTIME_MARGIN, forced: float | None = None, *,
                 sample_rate: int = 24000, start_buffer_s: float = LISTENER_START_BUFFER_S,
                 window_s: float = CAPACITY_WINDOW_S, measured_after_s: float = MEASURED_AFTER_S,
                 clock: Callable[[], float] = time.monotonic, on_change: Callable[[], None] | None = None):
        if margin < 0 or (forced is not None and forced <= 0):
            raise ValueError(f"margin ({margin}) must be >= 0 and a forced capacity ({forced}) > 0")
        self.margin = margin
        self.forced = forced
        self.default = COLD_STREAMS * (margin or DEFAULT_REALTIME_MARGIN)
        self.sample_rate = sample_rate
        self.start_buffer_s = start_buffer_s
        self.window_s = window_s
        self.measured_after_s = measured_after_s
        self.clock = clock
        self.on_change = on_change
        self.starved = 0  # streams whose listener stalled at least once
        self.stall_s = 0.0  # their stalls, summed
        self._lock = threading.Lock()
        self._open: dict[int, Playback] = {}
        self._ids = iter(range(1 << 62))
        self._audio = 0.0  # audio made while streams were open (exponentially forgotten)
        self._busy = 0.0  # wall seconds with streams open (the same forgetting)
        self._busy_total = 0.0  # never forgotten: measured yet?
        self._last = clock()

    # ---- what admission reads ------------------------------------------------------------------------------
    @property
    def measured(self) -> bool:
        return self.forced is None and self._busy_total >= self.measured_after_s

    def estimate(self) -> float:
        """Audio seconds made per wall second, all streams together."""
        with self._lock:
            if self.forced is not None:
                return self.forced
            if self._busy_total < self.measured_after_s or self._busy <= 0:
                return self.default
            return self._audio / self._busy

    def slots(self, max_streams: int) -> int:
        """floor(capacity / margin) streams; floor(capacity) while every open stream's listener holds at least
        BUFFERED_MARGIN_S of audio: the margin is then in the listeners' buffers. Without this a server whose
        lone stream runs under margin x 2 real time would never run two, so never measure what two make
        together (batching adds), and stay at one stream however much the batch would give."""
        estimate = self.estimate()
        slots = realtime_slots(estimate, self.margin, max_streams)
        if self.margin > 1 and self._open and self._all_buffered(BUFFERED_MARGIN_S):
            return max(slots, realtime_slots(estimate, 1.0, max_streams))
        return slots

    def _all_buffered(self, seconds: float) -> bool:
        now = self.clock()
        with self._lock:
            return all(p.played_until is not None and p.lead(now) >= seconds for p in self._open.values())

    def stalled(self) -> bool:
        """Whether a running stream's listener is waiting for audio right now."""
        now = self.clock()
        with self._lock:
            return any(p.played_until is not None and p.lead(now) < 0 for p in self._open.values())

    @property
    def open_streams(self) -> int:
        return len(self._open)

    # ---- following streams ------------------------------------------------------------------------------------
    def watch(self, chunks: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
        """`chunks` as they come, each one's audio counted and heard by the stream's listener."""
        key = self._opened()
        try:
            for chunk in chunks:
                if isinstance(chunk, np.ndarray) and chunk.size:  # not a speech mark (pipeline/speech_marks.py)
                    self._made(key, chunk.size / self.sample_rate)
                yield chunk
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
            self._closed(key)

    def _opened(self) -> int:
        with self._lock:
            self._advance()
            key = next(self._ids)
            self._open[key] = Playback(self.start_buffer_s)
        self._changed()
        return key

    def _made(self, key: int, seconds: float) -> None:
        with self._lock:
            now = self._advance()
            self._audio += seconds
            playback = self._open[key]
            lead = playback.add(now, seconds)
            if lead < -STALL_TOLERANCE_S:  # the listener waited: count the stream once, every stall's time
                if not any(s > STALL_TOLERANCE_S for s in playback.stalls[:-1]):
                    self.starved += 1
                self.stall_s += -lead
        self._changed()

    def _closed(self, key: int) -> None:
        with self._lock:
            self._advance()
            del self._open[key]
        self._changed()

    def _advance(self) -> float:
        """Add the wall time since the last event to the busy sums if streams were open (lock held)."""
        now = self.clock()
        elapsed = max(0.0, now - self._last)
        self._last = now
        if self._open and elapsed > 0:
            keep = math.exp(-elapsed / self.window_s)
            self._audio *= keep
            self._busy = self._busy * keep + elapsed
            self._busy_total += elapsed
        return now

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
