"""Per-request results and percentiles, shared by the load generator and the GPU mode (which must not
import the gRPC clients: the GPU image has no tritonclient)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from cosyvoice_triton.pipeline.playback import stalls

DEFAULT_START_BUFFER_S = 0.2  # the second stall figure: playback starts this long after the first chunk


@dataclass
class RequestResult:
    first_chunk_s: float | None = None
    second_chunk_s: float | None = None
    total_s: float = 0.0
    audio_s: float = 0.0
    chunks: int = 0
    error: str | None = None
    arrivals: list[float] = field(default_factory=list)  # each chunk's arrival, seconds from sending
    chunk_audio_s: list[float] = field(default_factory=list)  # each chunk's audio seconds
    # from sending to the arrival of the chunk holding the first audible sample (pipeline/audible.py); None:
    # no audible sample (or not measured)
    first_audible_s: float | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def stall_summary(results: list[RequestResult], start_buffer_s: float = DEFAULT_START_BUFFER_S) -> dict:
    """Playback stalls of the streams that sent audio (pipeline/playback.py), per level: the share of
    streams with any stall, p50/p99 of the stall time per stream, stalls per stream (mean) and the worst
    single stall; playback starting at the first chunk, and (`buffered_*`) `start_buffer_s` after it."""
    streams = [r for r in results if r.arrivals]
    out: dict = {"start_buffer_s": start_buffer_s, "streams": len(streams)}
    for prefix, buffer_s in (("", 0.0), ("buffered_", start_buffer_s)):
        each = [stalls(r.arrivals, r.chunk_audio_s, buffer_s) for r in streams]
        totals = [s.total_s for s in each]
        out[f"{prefix}stall_share"] = sum(s.count > 0 for s in each) / len(each) if each else None
        out[f"{prefix}stall_p50_s"] = percentile(totals, 50)
        out[f"{prefix}stall_p99_s"] = percentile(totals, 99)
        out[f"{prefix}stalls_mean"] = sum(s.count for s in each) / len(each) if each else None
        out[f"{prefix}worst_stall_s"] = max((s.worst_s for s in each), default=None)
    return out
