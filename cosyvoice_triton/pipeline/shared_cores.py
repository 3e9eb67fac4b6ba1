"""One server's cores shared across its processes: the `llm` and `token2wav` models of one tritonserver.

In tritonserver the LLM and token2wav are separate Python-backend processes, each with its own OpenMP
pool. Left alone, each keeps a fixed share of the cores: a stream's first chunk (what first audio waits
for) runs on token2wav's share beside the LLM's decode steps, and the LLM never gets the cores token2wav
leaves idle. `SharedCoreShare` is `CoreShare` (pipeline/threads.py) with its counts in a small file that
every process of the server maps, so the served path shares the cores exactly as the in-process
pipeline does: the LLM decodes on every core while token2wav is idle, a first chunk runs alone on every
core while the LLM's next decode round waits.

The file holds one slot per process: (pid, process start time, busy and alone units of each module).
Updates take an exclusive `flock` on the file; a unit that must wait polls every `POLL_S`. A slot whose
process is gone (a crash, a restart of the server in the same run folder) counts for nothing and is
taken over, so a dead process never holds the cores.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .threads import OTHER, CoreShare, Module, ThreadPlan

SLOT = struct.Struct("<qqiiii")  # pid, start time (clock ticks after boot), busy/alone llm, busy/alone token2wav
SLOTS = 64
POLL_S = 0.002
_FIELDS = {("busy", "llm"): 2, ("alone", "llm"): 3, ("busy", "token2wav"): 4, ("alone", "token2wav"): 5}


def process_start(pid: int) -> int | None:
    """When process `pid` started (field 22 of /proc/PID/stat), or None when there is no such process.
    With the pid it names one process: a pid the kernel hands out again comes with another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


class SharedCoreShare(CoreShare):
    """A `CoreShare` whose counts every process that opens the same `path` shares."""

    def __init__(self, path: str | Path, plan: ThreadPlan | None = None):
        super().__init__(plan)
        self.path = Path(path)
        self._pid = os.getpid()
        self._lock = threading.Lock()  # flock excludes other processes; this, this process's threads
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            if os.fstat(self._fd).st_size < SLOT.size * SLOTS:
                os.ftruncate(self._fd, SLOT.size * SLOTS)
            self._map = mmap.mmap(self._fd, SLOT.size * SLOTS)
            self._slot = self._claim_slot()

    def close(self) -> None:
        with self._locked():
            self._write(self._slot, (0, 0, 0, 0, 0, 0))
        self._map.close()
        os.close(self._fd)

    # ---- CoreShare's two waits, over the file ------------------------------------------------------

    def _enter(self, module: Module, alone: bool) -> bool:
        other = OTHER[module]
        announced = False  # this unit is counted as waiting to run alone
        while True:
            with self._locked():
                counts = self._counts()
                if not announced and counts[("alone", other)] == 0:
                    if not alone:
                        self._add(("busy", module), 1)
                        return counts[("busy", other)] > 0
                    self._add(("alone", module), 1)
                    announced = True
                if announced and counts[("busy", other)] == 0:
                    self._add(("busy", module), 1)
                    return False
            time.sleep(POLL_S)

    def idle(self, module: Module) -> bool:
        with self._locked():
            return self._counts()[("busy", module)] == 0

    def _leave(self, module: Module, alone: bool) -> None:
        with self._locked():
            self._add(("busy", module), -1)
            if alone:
                self._add(("alone", module), -1)

    # ---- the file ------------------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read(self, index: int) -> tuple[int, ...]:
        return SLOT.unpack_from(self._map, index * SLOT.size)

    def _write(self, index: int, values: tuple[int, ...]) -> None:
        SLOT.pack_into(self._map, index * SLOT.size, *values)

    def _alive(self, slot: tuple[int, ...]) -> bool:
        pid, start = slot[0], slot[1]
        return pid == self._pid or (pid != 0 and process_start(pid) == start)

    def _claim_slot(self) -> int:
        """A slot for this process: a free one, or one whose process is gone. Hold the lock."""
        for index in range(SLOTS):
            if not self._alive(self._read(index)):
                self._write(index, (self._pid, process_start(self._pid) or 0, 0, 0, 0, 0))
                return index
        raise RuntimeError(f"{self.path}: all {SLOTS} core-share slots are taken by live processes")

    def _counts(self) -> dict[tuple[str, str], int]:
        """Busy and alone units per module over the live processes' slots; a dead one's are cleared."""
        counts = dict.fromkeys(_FIELDS, 0)
        for index in range(SLOTS):
            slot = self._read(index)
            if slot[0] == 0 or not any(slot[2:]):
                continue
            if not self._alive(slot):
                self._write(index, (0, 0, 0, 0, 0, 0))
                continue
            for key, field in _FIELDS.items():
                counts[key] += slot[field]
        return counts

    def _add(self, key: tuple[str, str], delta: int) -> None:
        values = list(self._read(self._slot))
        values[_FIELDS[key]] += delta
        self._write(self._slot, tuple(values))
