"""`IdleSweeper`: a timer thread that frees abandoned token2wav streams while no chunk comes.

Every `interval_s` it calls `free_idle()` (the scheduler's `sweep_idle`, which reads the scheduler's own clock
and returns the ids it freed) under the scheduler's lock, and, when something was freed, `wake()`. The
token2wav model's `wake` sends the model a no-op request over BLS so that an `execute`, on the stub's
main thread, publishes the frees in the metrics: the sweeper itself never touches metrics (see
model_repository/token2wav/1/model.py). The loop waits on an Event, so `stop` ends it at once.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

log = logging.getLogger(__name__)


class IdleSweeper:
    def __init__(self, free_idle: Callable[[], Sequence[str]], wake: Callable[[], None], interval_s: float,
                 lock: AbstractContextManager | None = None, name: str = "idle-sweeper"):
        """`lock` is held around each `free_idle()` (the scheduler has one caller at a time), not around
        `wake()`, which may make the model run an execute that takes the same lock."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._free_idle = free_idle
        self._wake = wake
        self._lock = lock if lock is not None else nullcontext()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the loop; no `free_idle` or `wake` starts after this returns (one under way may finish)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def sweep_once(self) -> list[str]:
        """Free the idle streams now; wake the model if any was freed. Returns the freed ids."""
        with self._lock:
            freed = list(self._free_idle())
        if freed and not self._stop.is_set():
            self._wake()
        return freed

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep_once()
            except Exception:  # noqa: BLE001 - one failed sweep or wake; the next round tries again
                log.exception("idle sweep failed")
