"""What a listener hears from a stream of audio chunks: its lead, and the stalls when it runs dry.

The listener starts playing `start_buffer_s` after the first chunk arrives and plays the chunks back to
back. When a chunk arrives after the audio before it has finished playing, playback pauses (a stall)
and resumes with that chunk. The **lead** at a moment is the audio that has arrived and not been played
yet: until the first stall it is "audio already sent minus wall time since the first chunk" (minus the
start buffer); a negative lead when a chunk arrives is the stall that chunk ends.

`Playback` follows one stream as its chunks come (the server's lead metric, the adaptive chunk policy);
`stalls` is the same computation over a finished stream's arrival times (the benchmarks).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stalls:
    count: int  # chunks that arrived after the audio before them had finished playing
    total_s: float  # seconds the listener waited, summed
    worst_s: float  # the longest single wait


class Playback:
    """The listener of one stream. Times are seconds on any one clock (e.g. time.monotonic())."""

    def __init__(self, start_buffer_s: float = 0.0):
        if start_buffer_s < 0:
            raise ValueError(f"start_buffer_s must be >= 0, got {start_buffer_s}")
        self.start_buffer_s = start_buffer_s
        self.played_until: float | None = None  # when the audio received so far runs out; None: no chunk yet
        self.stalls: list[float] = []  # each stall's length, in order

    def lead(self, now: float) -> float:
        """Seconds of received audio not yet played at `now` (0 before the first chunk); negative: the
        listener has been waiting that long."""
        return 0.0 if self.played_until is None else self.played_until - now

    def add(self, now: float, duration_s: float) -> float:
        """A chunk of `duration_s` seconds arrives at `now`. Returns the lead just before it (as `lead`)."""
        if self.played_until is None:
            self.played_until = now + self.start_buffer_s + duration_s
            return 0.0
        lead = self.played_until - now
        if lead < 0:  # the listener ran dry: it waited -lead seconds and resumes with this chunk
            self.stalls.append(-lead)
            self.played_until = now
        self.played_until += duration_s
        return lead

    def summary(self) -> Stalls:
        return Stalls(count=len(self.stalls), total_s=sum(self.stalls), worst_s=max(self.stalls, default=0.0))


def stalls(arrivals: Sequence[float], durations: Sequence[float], start_buffer_s: float = 0.0) -> Stalls:
    """Stalls of one stream whose chunk i (durations[i] seconds of audio) arrived at arrivals[i]."""
    if len(arrivals) != len(durations):
        raise ValueError(f"{len(arrivals)} arrival times for {len(durations)} chunks")
    playback = Playback(start_buffer_s)
    for now, duration in zip(arrivals, durations):
        playback.add(now, duration)
    return playback.summary()
