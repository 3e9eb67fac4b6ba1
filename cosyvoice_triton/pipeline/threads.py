"""How many torch threads the LLM and token2wav get, from the cores this process may use.

The two run at the same time (the LLM decodes the next tokens while token2wav turns a chunk into
audio), so together they ask for no more threads than there are cores: with more, OpenMP's workers
wait on each other and both slow down. `thread_plan` splits the cores:
- LLM: a decode step is a chain of matrix-vector products, one token per stream, bound by memory
  bandwidth more than by arithmetic; past a few threads it gains little. It gets a third of the cores,
  at least 1 and at most `LLM_MAX_THREADS`.
- token2wav: the flow's estimator and HiFT run convolutions and attention over hundreds of frames per
  call, which keep every thread busy. It gets the rest, at least 1.
On 2 cores each gets 1. `CoreShare` then moves cores to where the work is: it gives the LLM every core
while token2wav is idle and its share while token2wav runs; token2wav gets its share for a stream's middle
chunks, and every core for its first chunk (what first audio waits for: the LLM's decode steps wait
while it runs, a unit run `alone`) and its last (which comes after the LLM's end). Its count is fixed per
chunk kind (`chunk_unit`), not by what runs beside it: the flow's sums come out differently (by ~1e-6) at
different thread counts, and a seed's audio must not depend on timing. (The LLM's logits are the same
at any count, and only when its steps run depends on the first chunk.) The flow estimator's rows are the
exception (`RowWorkers`): each runs on a fixed count of its own, so how many run at once may follow the
cores free at each step.

`CoreShare` keeps its counts in this process (the in-process pipeline's threads);
`pipeline/shared_cores.py` keeps the same counts in a file that the `llm` and `token2wav` processes of
one tritonserver share, so that the served path shares the cores as the in-process one does.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any, Iterator, Literal

from ..messages import ChunkRequest

LLM_MAX_THREADS = 4
Module = Literal["llm", "token2wav"]
OTHER: dict[str, Module] = {"llm": "token2wav", "token2wav": "llm"}


@dataclass(frozen=True)
class ThreadPlan:
    cores: int
    llm: int  # torch threads of the LLM while token2wav runs beside it
    token2wav: int  # torch threads of token2wav while the LLM runs beside it

    def of(self, module: Module) -> int:
        return self.llm if module == "llm" else self.token2wav


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_plan(cores: int | None = None) -> ThreadPlan:
    cores = max(1, cores or available_cores())
    llm = min(LLM_MAX_THREADS, max(1, cores // 3))
    return ThreadPlan(cores=cores, llm=llm, token2wav=max(1, cores - llm))


_thread_counts = threading.local()  # .count: the last count set_torch_threads gave this thread


def set_torch_threads(count: int) -> None:
    """Set the calling thread's torch thread count (OpenMP keeps one per thread), when it differs."""
    import torch

    if getattr(_thread_counts, "count", None) != count:
        torch.get_num_threads()  # torch's first-use setup of this thread, which would reset the count later
        torch.set_num_threads(count)
        _thread_counts.count = count


def is_first(chunk: ChunkRequest) -> bool:
    """A stream's first chunk: the only one that carries its prompt."""
    return chunk.prompt is not None


def chunk_unit(plan: ThreadPlan, chunks: Sequence[ChunkRequest], first_chunk_alone: bool = True) -> tuple[int, bool]:
    """(torch threads, alone) of one token2wav call over `chunks`: every core, alone, when a first chunk
    is among them (first audio waits for it); every core beside the LLM for a last chunk (its stream's LLM
    has ended); else token2wav's share. Fixed per chunk kind, so a seed's audio does not depend on timing."""
    alone = first_chunk_alone and any(is_first(chunk) for chunk in chunks)
    every_core = alone or any(chunk.finalize for chunk in chunks)
    return (plan.cores if every_core else plan.token2wav), alone


class CoreShare:
    """The cores of one pipeline, shared by its LLM and token2wav threads.

    Each unit of work (one LLM decode round, one token2wav call) runs inside `running(module)`, which sets
    the calling thread's torch threads: every core when the other module is idle, the plan's share when
    it is busy, or the count given (token2wav's, fixed per chunk kind). A unit keeps its count to its end.
    A unit run `alone` waits for the other module's unit in progress to end, and the other module's next
    units wait for it to end: it has the cores to itself. The counts live in this process
    (`SharedCoreShare` keeps them in a file for several processes)."""

    def __init__(self, plan: ThreadPlan | None = None):
        self.plan = plan or thread_plan()
        self._busy = {"llm": 0, "token2wav": 0}
        self._alone = {"llm": 0, "token2wav": 0}  # units run alone, running or waiting to
        self._changed = threading.Condition()

    @contextmanager
    def running(self, module: Module, threads: int | None = None, alone: bool = False) -> Iterator[int]:
        shared = self._enter(module, alone)
        if threads is None:
            threads = self.plan.of(module) if shared else self.plan.cores
        set_torch_threads(threads)
        try:
            yield threads
        finally:
            self._leave(module, alone)

    def idle(self, module: Module) -> bool:
        """Whether `module` runs no unit now (a glance: it may start one the next moment)."""
        return self._busy[module] == 0

    def _enter(self, module: Module, alone: bool) -> bool:
        """Wait until `module` may run a unit and count it; whether the other module is busy beside it."""
        other = OTHER[module]
        with self._changed:
            self._changed.wait_for(lambda: self._alone[other] == 0)
            if alone:
                self._alone[module] += 1
                self._changed.wait_for(lambda: self._busy[other] == 0)
            self._busy[module] += 1
            return self._busy[other] > 0

    def _leave(self, module: Module, alone: bool) -> None:
        with self._changed:
            self._busy[module] -= 1
            self._alone[module] -= alone
            self._changed.notify_all()


class RowWorkers:
    """The flow estimator's rows (each stream's two guidance halves, models/flow_cache.py `_solve_by_row`)
    spread over the cores token2wav may use at each Euler step.

    Every row runs on `threads_per_row` torch threads, whichever thread runs it (a fixed count per
    process: half the cores, at least 1), so its sums are the same however many rows run beside it. That
    frees the number of rows in flight from the "fixed per chunk kind" rule above: a middle chunk runs
    its rows on token2wav's share while the LLM decodes, and on every core once the LLM is idle (at one
    stream, from its last token on), where a chunk's thread count had to stay at the share to its end.
    Rows in parallel also beat one OpenMP team over the batch on two cores (no barrier per operation).
    The LLM, starting a round while the rows hold every core, runs beside them until the next step, which
    takes token2wav's share again."""

    def __init__(self, share: CoreShare):
        self.share = share
        self.threads_per_row = max(1, share.plan.cores // 2)
        self.max_lanes = max(1, share.plan.cores // self.threads_per_row)
        self._pool = (ThreadPoolExecutor(max_workers=self.max_lanes - 1, thread_name_prefix="flow-rows")
                      if self.max_lanes > 1 else None)

    def lanes(self, unit_threads: int) -> int:
        """Rows in flight now: the cores of the calling unit, or every core while the LLM is idle."""
        cores = self.share.plan.cores if self.share.idle("llm") else unit_threads
        return min(self.max_lanes, max(1, cores // self.threads_per_row))

    def map(self, fn: Callable[[Any], Any], rows: Sequence[Any]) -> list:
        """[fn(row) for row in rows], in lanes: lane 0 in the calling thread, the others in the pool."""
        import torch

        if not rows:
            return []
        unit_threads = torch.get_num_threads()
        lanes = min(len(rows), self.lanes(unit_threads))

        def lane(indices: range) -> list:
            set_torch_threads(self.threads_per_row)
            return [fn(rows[i]) for i in indices]

        others = [self._pool.submit(lane, range(i, len(rows), lanes)) for i in range(1, lanes)]
        try:
            mine = lane(range(0, len(rows), lanes))
        finally:
            set_torch_threads(unit_threads)  # the unit's count again, for its encoder and HiFT calls
        results: list = [None] * len(rows)
        results[0::lanes] = mine
        for i, future in enumerate(others, start=1):
            results[i::lanes] = future.result()
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
