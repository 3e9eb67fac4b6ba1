"""Per-request results and percentiles, shared by the load generator and the GPU mode (which must not
import the gRPC clients: the GPU image has no tritonclient)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RequestResult:
    first_chunk_s: float | None = None
    second_chunk_s: float | None = None
    total_s: float = 0.0
    audio_s: float = 0.0
    chunks: int = 0
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
