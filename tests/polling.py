"""Waiting in tests for something another thread or process makes true."""
from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.05) -> None:
    """Poll `predicate` until it is true; fail the test after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met in {timeout_s:.0f} s"
        time.sleep(interval_s)
