"""Keep the Python-backend stub's health thread ahead of the model's own work: `yield_to_stub_health()`, called
first in each model.py, raises the nice value of the stub's main thread (and so of every thread the model starts)
by MODEL_NICE_INCREMENT. A health thread starved for a second makes tritonserver give the stub up and then crash
(why, and what was measured: docs/operations/faults.md).
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
