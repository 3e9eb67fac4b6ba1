"""Keep the Python-backend stub's health thread ahead of the model's own work.

tritonserver's Python backend (2.51, and unchanged in later releases) knows a stub is alive by one thread of
the stub, started before the stub imports `model.py`: every 300 ms it sets a flag in shared memory. While
tritonserver waits for the stub's answer to `initialize` or `execute`, it clears the flag every second and
gives the stub up when the flag is still clear a second later. Giving up is not harmless: the server frees
the shared memory of the message the stub is still working on, the stub writes into it when it runs again,
and the server dies soon after (`boost::interprocess::lock_exception`, SIGSEGV or SIGBUS;
docs/operations/faults.md). So that thread must get a core at least once a second, however busy the server.

What keeps it from one is CPU-bound work in its own scheduling group (the server's process session, or the
container's cgroup): a thread that wakes up there may wait its turn behind the group's busy threads; on 2
cores, behind 12 of them (and the other process groups busy too), up to 1.26 s. With those 12 at nice 5 it waited
at most 0.05 s.

On Linux the nice value belongs to a thread and a new thread takes its creator's. `yield_to_stub_health()`,
called first in each model.py (on the stub's main thread, which the health thread already runs beside),
raises that thread's nice value by MODEL_NICE_INCREMENT: the model's import, `initialize`, `execute` and
every thread they start (workers, torch's) run below the health thread, which keeps the server's priority,
as tritonserver's own threads do. Only the order inside the server changes: the health thread sleeps nearly
all the time, so the model's threads share the cores among themselves as before, and under Linux's session
groups the server's share of the machine does not depend on its threads' nice values.
"""
from __future__ import annotations

import os
import sys

MODEL_NICE_INCREMENT = 5
# The module that the stub builds into its interpreter: present only inside a Python-backend stub.
_STUB_MODULE = "c_python_backend_utils"
_lowered = False


def in_stub() -> bool:
    return _STUB_MODULE in sys.builtin_module_names


def yield_to_stub_health() -> None:
    """Inside a stub, once per process: this thread (and what it starts from now on) below the health thread.
    Elsewhere (tests that import a model.py with a stand-in pb_utils, the library in-process) nothing."""
    global _lowered
    if _lowered or not in_stub():
        return
    os.nice(MODEL_NICE_INCREMENT)  # raising one's own nice value needs no privilege
    _lowered = True
