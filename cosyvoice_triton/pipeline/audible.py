"""When a stream of audio becomes audible: its first sample above a silence threshold.

A first chunk that starts with silence is not heard sooner than its first sound, so the benchmarks, the
access log and the metrics report **first audible audio** beside the first chunk.

The rule (one for the server, the gateway, the benchmarks and the web page's timeline.js): the stream
is audible from the first window of `window_ms` (10 ms) whose RMS is above `threshold_dbfs` (-50 dBFS;
0 dBFS is an RMS of 1.0, full scale of float samples in [-1, 1]), and its **first audible sample** is the
first sample of that window whose own level is above the threshold (|x| above 10^(dBFS/20); a window
above it always holds one). The window decides whether there is sound (a lone click below 10 ms worth of
energy is not), the sample where it begins: the window's start itself may lie up to 10 ms before the
sound, in silence, and, at a chunk boundary, in the silent chunk before the one that brings the sound,
which would date the sound to that earlier chunk's arrival. Every window is tried, one per sample (a
sliding window with a hop of one sample, by running sums of squares): the answer is then a property of
the samples alone, the same whether they come whole or cut into chunks of any size, which a hop of 1 ms or
non-overlapping windows would not be (their grid would move with a chunk's length). Windows that run past
the end of the stream count what follows as silence (`finish`). A stream in which no window is above the
threshold has no audible sample (None).

**Time of first audible audio** of a stream: the wall time when the chunk that holds the first audible
sample arrived (was sent, on the server's side), minus the same origin as the first chunk's time. That
is what a client can measure; the listener hears it when that chunk plays. The sample's position inside
its chunk adds nothing (a chunk arrives whole). Since a window may end in a later chunk, the detector
can tell only once that chunk arrived; the time reported is still the arrival of the chunk holding the
sample, which the detector remembers (`at`).

This module needs numpy only: perf/official_driver.py loads it by path in the official code's virtualenv.
"""
from __future__ import annotations

import math

import numpy as np

DEFAULT_THRESHOLD_DBFS = -50.0
DEFAULT_WINDOW_MS = 10.0


class AudibleDetector:
    """Feed one stream's chunks in order (float samples in [-1, 1]); `offset` becomes the sample offset of
    its first audible sample once it is known, and `at` the `at` its chunk was fed with.

    Keeps only the last window's samples but one between chunks; after the answer, feeding costs nothing."""

    def __init__(self, sample_rate: int, threshold_dbfs: float = DEFAULT_THRESHOLD_DBFS,
                 window_ms: float = DEFAULT_WINDOW_MS):
        if sample_rate <= 0 or window_ms <= 0 or not math.isfinite(threshold_dbfs):
            raise ValueError(f"sample_rate ({sample_rate}) and window_ms ({window_ms}) must be positive and "
                             f"threshold_dbfs ({threshold_dbfs}) finite")
        self.window = max(1, math.floor(window_ms * sample_rate / 1000 + 0.5))  # samples (as JavaScript rounds)
        self.level = 10.0 ** (threshold_dbfs / 10)  # mean square (a sample's square) of the threshold
        self.threshold = self.window * self.level  # a window's sum of squares must exceed it
        self.offset: int | None = None  # the first audible sample, once known
        self.at: float | None = None  # when the chunk holding it arrived (as fed)
        self.fed = 0  # samples fed
        self._tail = np.zeros(0, dtype=np.float64)  # the last window - 1 samples fed, or fewer: (<= window - 1,)
        self._tail_start = 0  # the sample offset of _tail[0]
        self._chunks: list[tuple[int, float | None]] = []  # (first sample, at) of the chunks _tail reaches into

    @property
    def found(self) -> bool:
        return self.offset is not None

    def feed(self, chunk: np.ndarray, at: float | None = None) -> bool:
        """The next chunk, which arrived at `at` (any clock). True at the one call that finds the first
        audible sample (in this chunk or in one before it)."""
        samples = np.asarray(chunk, dtype=np.float64).reshape(-1)
        if self.found or samples.size == 0:
            return False
        self._chunks.append((self.fed, at))
        self.fed += samples.size
        return self._scan(samples)

    def finish(self) -> bool:
        """The stream ended: windows that run past its end are tried with silence after it. True if that
        finds the first audible sample."""
        if self.found or self.fed == 0:
            return False
        return self._scan(np.zeros(self.window - 1, dtype=np.float64))

    def _scan(self, new: np.ndarray) -> bool:
        """Try every window that ends in `new` (those before it were tried with the chunks before)."""
        data = np.concatenate([self._tail, new])  # (tail + new,), from sample _tail_start
        squares = np.concatenate([[0.0], np.cumsum(data * data)])  # (len(data) + 1,)
        sums = squares[self.window:] - squares[:-self.window]  # a window's sum of squares per start in data
        above = np.flatnonzero(sums > self.threshold)
        if above.size:  # windows starting past the samples fed hold silence only: never above
            start = int(above[0])
            loud = np.flatnonzero(data[start:start + self.window] ** 2 > self.level)  # never empty: max >= mean
            self.offset = self._tail_start + start + int(loud[0])
            self.at = next(at for first, at in reversed(self._chunks) if first <= self.offset)
            self._tail, self._chunks = self._tail[:0], []
            return True
        keep = min(data.size, self.window - 1)
        self._tail, self._tail_start = data[data.size - keep:], self._tail_start + data.size - keep
        self._chunks = [c for c, after in zip(self._chunks, self._chunks[1:] + [(self.fed, None)])
                        if after[0] > self._tail_start]
        return False


def first_audible(audio: np.ndarray, sample_rate: int, threshold_dbfs: float = DEFAULT_THRESHOLD_DBFS,
                  window_ms: float = DEFAULT_WINDOW_MS) -> int | None:
    """The sample offset of the first audible sample of a whole recording (None: none is audible)."""
    detector = AudibleDetector(sample_rate, threshold_dbfs, window_ms)
    detector.feed(audio)
    detector.finish()
    return detector.offset
