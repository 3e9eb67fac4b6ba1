"""CUDA graphs of the served hot loops, one per shape bucket: the LLM's decode step per slot-count bucket
(llm/decode_graphs.py) and the flow estimator's step per (rows, frames) bucket (`EstimatorGraphs`).

A CUDA graph replays fixed shapes. So a call is padded up to the smallest bucket that holds it, copied into
that bucket's captured inputs, replayed, and its own rows (and frames) are cut from the captured output.
Padding changes nothing the caller keeps: padded LLM rows write into a scratch cache slot of their own;
padded estimator frames are masked (every convolution is causal and fed `x * mask`, attention never sees a
masked key) and padded estimator rows are all mask.

A bucket is captured on first use (a few warm-up calls, then one recording) and may be warmed at load.
The graphs of one `GraphTable` share one memory pool: they replay one at a time, on the caller's thread,
and each output is copied out before the next replay.

Setting (`serve --cuda-graphs`): off | on | auto; auto = on for a CUDA device. Fallbacks, one log line
each, then eager: the device is not CUDA; a capture fails (eager for the rest of the process); a call
beyond the largest bucket (eager for that call: an estimator call of more frames than the buckets hold).
HiFT is not captured: it is non-causal, so padding would change its output, and one graph per exact
length would be captured for almost every call.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.flow_estimator import FlowEstimator
from .torch_runner import CudaGraphCall

log = logging.getLogger(__name__)

CUDA_GRAPH_SETTINGS = ("off", "auto", "on")
FRAME_BUCKET = 100  # estimator frames are padded up to a multiple of this (2 s of mel)
MAX_GRAPH_FRAMES = 3000  # estimator calls of more frames (60 s, prompt included) run eager

# capture(fn, example_inputs) -> a call with inputs of the example's shapes that returns fn's output
Capture = Callable[[Callable[..., Tensor], tuple[Tensor, ...]], Callable[..., Tensor]]


def check_cuda_graphs_setting(setting: str) -> str:
    if setting not in CUDA_GRAPH_SETTINGS:
        raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPH_SETTINGS)}, got {setting!r}")
    return setting


def use_cuda_graphs(setting: str, device: torch.device | str) -> bool:
    """Whether `setting` captures graphs on `device`: on and auto on CUDA devices; `on` elsewhere logs why not."""
    check_cuda_graphs_setting(setting)
    cuda = torch.device(device).type == "cuda"
    if setting == "on" and not cuda:
        log.warning("CUDA graphs need a CUDA device, not %s: running eager", device)
    return setting != "off" and cuda


def power_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `limit`, then `limit`."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    buckets = [1]
    while buckets[-1] * 2 < limit:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets) + ((limit,) if buckets[-1] != limit else ())


def step_buckets(limit: int, step: int) -> tuple[int, ...]:
    """step, 2 step, ... up to the first multiple of `step` at or above `limit`."""
    return tuple(range(step, limit + step, step))


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds n, or None if none does."""
    return next((bucket for bucket in buckets if bucket >= n), None)


def cuda_capture() -> Capture:
    """`CudaGraphCall` with one memory pool for every graph it captures."""
    pool = None

    def capture(fn: Callable[..., Tensor], example_inputs: tuple[Tensor, ...]) -> CudaGraphCall:
        nonlocal pool
        if pool is None and example_inputs[0].is_cuda:
            pool = torch.cuda.graph_pool_handle()
        return CudaGraphCall(fn, example_inputs, pool=pool)

    return capture


class GraphTable:
    """Captured calls by bucket key, each captured on its first use; eager for good after a failed capture."""

    def __init__(self, name: str, capture: Capture | None = None):
        self.name = name
        self.capture = capture if capture is not None else cuda_capture()
        self.graphs: dict[Hashable, Callable[..., Tensor]] = {}
        self.failure: str | None = None  # why capturing stopped; None while it works

    def get(self, key: Hashable, fn: Callable[..., Tensor], example: Callable[[], tuple[Tensor, ...]]
            ) -> Callable[..., Tensor] | None:
        """The graph of `key`, captured now from fn and `example()`'s inputs if new; None after a failed capture."""
        if self.failure is not None:
            return None
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self.graphs[key] = self.capture(fn, example())
            except Exception as exc:  # noqa: BLE001 - e.g. no CUDA device, an operator that syncs
                self.failure = f"{type(exc).__name__}: {exc}"
                log.warning("%s: CUDA graph capture failed for bucket %s (%s); eager from now on",
                            self.name, key, self.failure)
                return None
        return graph


def pad_rows(x: Tensor, rows: int, value: float | bool = 0) -> Tensor:
    """x (B, ...) -> (rows, ...): rows B.. filled with `value`."""
    if x.size(0) == rows:
        return x
    fill = torch.full((rows - x.size(0), *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, fill])


class EstimatorGraphs(nn.Module):
    """The flow estimator's call, replayed from a CUDA graph per (rows, frames) bucket; in the estimator's
    place (`flow.decoder.estimator`), with its positional call:
    (x, mask, mu, t, spks, cond, streaming) -> velocity (B, 80, T).

    Graph engines recompute every frame, so a flow with these graphs keeps no flow cache
    (models/flow_cache.py `supports_cache`)."""

    def __init__(self, estimator: nn.Module, max_rows: int, capture: Capture | None = None,
                 max_frames: int = MAX_GRAPH_FRAMES, frame_bucket: int = FRAME_BUCKET):
        super().__init__()
        self.estimator = estimator
        self.row_buckets = power_buckets(max_rows)
        self.frame_buckets = step_buckets(max_frames, frame_bucket)
        self.table = GraphTable("flow estimator step", capture)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: Tensor) -> Tensor:
        B, _, T = x.shape
        rows, frames = bucket_for(B, self.row_buckets), bucket_for(T, self.frame_buckets)
        graph = None
        if rows is not None and frames is not None:
            # Autocast (a bf16 estimator) is part of what is recorded.
            key = (rows, frames, torch.is_autocast_enabled(x.device.type))
            graph = self.table.get(key, self.estimator, lambda: self.example(rows, frames, x))
        if graph is None:
            return self.estimator(x, mask, mu, t, spks, cond, streaming)

        def padded(v: Tensor) -> Tensor:  # (B, C, T) -> (rows, C, frames), zeros after
            return pad_rows(F.pad(v, (0, frames - T)), rows)

        out = graph(padded(x), padded(mask), padded(mu), pad_rows(t, rows), pad_rows(spks, rows), padded(cond),
                    pad_rows(streaming, rows, False))
        return out[:B, :, :T].clone()  # (B, 80, T): the graph's output is overwritten by the next replay

    def example(self, rows: int, frames: int, like: Tensor) -> tuple[Tensor, ...]:
        """Inputs of one bucket's shapes for its capture: every frame valid, full attention."""
        mel_bins, dtype, device = like.size(1), like.dtype, like.device  # spks: projected to mel_bins wide
        zeros = torch.zeros(rows, mel_bins, frames, dtype=dtype, device=device)
        return (zeros, torch.ones(rows, 1, frames, dtype=dtype, device=device), zeros.clone(),
                torch.zeros(rows, dtype=dtype, device=device), torch.zeros(rows, mel_bins, dtype=dtype, device=device),
                zeros.clone(), torch.zeros(rows, dtype=torch.bool, device=device))


def capture_estimator_steps(flow: nn.Module, max_batch: int, capture: Capture | None = None) -> bool:
    """Put `EstimatorGraphs` in the place of the torch flow estimator of `flow` (a `FlowModel`); `max_batch`
    chunks per flow call make 2 * max_batch estimator rows (guidance). False, changing nothing, when the
    estimator is already a graph engine's."""
    solver = flow.decoder
    if not isinstance(solver.estimator, FlowEstimator):
        return False
    solver.estimator = EstimatorGraphs(solver.estimator, 2 * max_batch, capture)
    return True
