"""Keep a service's processes running: a process that exits on its own is started again, with backoff.

```
supervisor = Supervisor({"frontend-0": topology.frontends[0], "backend-0": ..., "redis": topology.redis})
supervisor.begin()          # one thread watches them all and restarts the dead ones
supervisor.states()         # {"frontend-0": {"state": "running", "restarts": 0, "pid": 123, ...}, ...}
supervisor.close(topology.stop)   # no more restarts; `stop` runs while the watching thread still lives
```
A supervised process has `is_running()`, `exit_code` and `restart()` (start again on the same ports, so
that clients, the gateway and other servers keep its address; raises when it does not come up). The
first restart waits `initial_delay_s`, each failed one doubles the wait up to `max_delay_s`, and a
process that stays up for `stable_s` starts again from the initial delay.

A process may also be watched for liveness (`liveness`: name -> a `Liveness` of server/liveness.py): one
that runs but whose models stopped answering (a hang) is killed, then restarted as if it had died
(`hangs` counts these).

Restarts run in the supervisor's thread, which lives until `close()` has stopped the processes: the
kernel's parent-death signal (`die_with_parent`) follows the thread that started a child.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often the processes are looked at (Popen.poll: no syscall storm)

RUNNING, RESTARTING, STOPPED = "running", "restarting", "stopped"


class Supervised(Protocol):
    @property
    def exit_code(self) -> int | None: ...

    def is_running(self) -> bool: ...

    def restart(self) -> object: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class Backoff:
    initial_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_s: float = 60.0  # up this long: the next failure waits `initial_delay_s` again

    def next(self, delay_s: float) -> float:
        return min(self.max_delay_s, delay_s * 2)


@dataclass
class ProcessState:
    """What `/readyz` and the metrics report about one supervised process."""

    name: str
    group: str  # processes of one group stand in for each other: "frontend", "backend", "tritonserver", "redis"
    state: str = RUNNING
    restarts: int = 0  # successful restarts
    hangs: int = 0  # times it was killed because its models stopped answering
    last_exit_code: int | None = None
    last_error: str | None = None  # why the last restart failed
    delay_s: float = 0.0
    next_attempt: float = 0.0  # time.monotonic() of the next restart
    up_since: float = 0.0

    def report(self) -> dict:
        body = {"state": self.state, "restarts": self.restarts, "hangs": self.hangs,
                "last_exit_code": self.last_exit_code}
        if self.last_error:
            body["last_error"] = self.last_error
        return body


def group_of(name: str) -> str:
    """"frontend-1" -> "frontend"; "redis" -> "redis"."""
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name


class Supervisor:
    def __init__(self, processes: Mapping[str, Supervised], backoff: Backoff = Backoff(),
                 liveness: Mapping[str, object] | None = None):
        self.processes = dict(processes)
        self.backoff = backoff
        self.liveness = dict(liveness or {})  # name -> Liveness (server/liveness.py)
        now = time.monotonic()
        self._states = {name: ProcessState(name, group_of(name), up_since=now) for name in self.processes}
        self._lock = threading.Lock()  # guards the states
        self._pass = threading.Lock()  # held while the thread looks at (and restarts) processes
        self._closing = threading.Event()
        self._released = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()
        for watch in self.liveness.values():
            watch.start()
        return self

    # -- what is reported ----------------------------------------------------------------------------
    def states(self) -> dict[str, dict]:
        with self._lock:
            return {name: {**state.report(), "pid": getattr(self.processes[name], "pid", None)}
                    for name, state in self._states.items()}

    def ready(self) -> bool:
        """Every group has at least one process running."""
        with self._lock:
            groups: dict[str, bool] = {}
            for state in self._states.values():
                groups[state.group] = groups.get(state.group, False) or state.state == RUNNING
        return all(groups.values())

    def waiting_for(self) -> list[str]:
        with self._lock:
            return [f"{name} ({state.state})" for name, state in self._states.items() if state.state != RUNNING]

    # -- the watching thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closing.wait(WATCH_INTERVAL_S):
            with self._pass:
                for name in self.processes:
                    if self._closing.is_set():
                        break
                    self._check(name)
        self._released.wait()  # the children this thread started must not get the parent-death signal yet

    def _check(self, name: str) -> None:
        process, state = self.processes[name], self._states[name]
        now = time.monotonic()
        if state.state == RUNNING:
            if process.is_running():
                self._kill_if_hung(name, process, state)
                return
            with self._lock:
                state.state, state.last_exit_code = RESTARTING, process.exit_code
                stable = now - state.up_since >= self.backoff.stable_s
                state.delay_s = self.backoff.initial_delay_s if stable or not state.delay_s else state.delay_s
                state.next_attempt = now + state.delay_s
            log.warning("%s exited (code %s); restarting it in %.1f s", name, state.last_exit_code, state.delay_s)
        if state.state == RESTARTING and now >= state.next_attempt:
            self._restart(name, process, state)

    def _kill_if_hung(self, name: str, process: Supervised, state: ProcessState) -> None:
        """A running process whose models stopped answering is killed: the next pass restarts it."""
        watch = self.liveness.get(name)
        hung = watch.hung if watch is not None else None
        if hung is None:
            return
        log.warning("%s is hung: %s answered none of %d liveness probes; killing it to restart it", name, hung,
                    watch.hung_after)
        with self._lock:
            state.hangs += 1
        process.kill()
        watch.reset()

    def _restart(self, name: str, process: Supervised, state: ProcessState) -> None:
        try:
            process.restart()
        except Exception as exc:  # noqa: BLE001 - reported in the state, retried after the backoff
            with self._lock:
                state.last_error = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                state.delay_s = self.backoff.next(state.delay_s)
                state.next_attempt = time.monotonic() + state.delay_s
            log.warning("%s did not restart (%s); next attempt in %.1f s", name, state.last_error, state.delay_s)
            return
        with self._lock:
            state.state, state.restarts, state.last_error = RUNNING, state.restarts + 1, None
            state.up_since = time.monotonic()
        log.warning("%s restarted (restart %d)", name, state.restarts)

    def close(self, stop: Callable[[], None] = lambda: None) -> None:
        """No more restarts (one under way finishes first); then `stop()` (which stops the processes)
        while the watching thread still lives; then the thread ends."""
        self._closing.set()
        for watch in self.liveness.values():
            watch.stop()
        try:
            with self._pass:
                stop()
        finally:
            with self._lock:
                for state in self._states.values():
                    state.state = STOPPED
            self._released.set()
            if self._thread is not None:
                self._thread.join()
