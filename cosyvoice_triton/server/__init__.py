"""Triton plumbing: find `tritonserver`, fill config templates, run server processes.

`binary` finds the executable and stages the Python backend; `templates` renders `config.pbtxt`
templates into a run folder; `process` starts and stops a server whose Python models import from a
chosen environment (its docstring records what the Python backend needs). (The stand-in for
`triton_python_backend_utils` that unit-tests a `model.py` without Triton is tests/pb_fake.py.)
"""
from __future__ import annotations

from cosyvoice_triton.server.binary import TritonBinary, TritonNotFound, find_tritonserver, stage_backend_directory
from cosyvoice_triton.server.process import (PythonEnv, TritonProcess, TritonStartError, free_port,
                                             server_environment)
from cosyvoice_triton.server.templates import TemplateError, model_names, render_repository, render_template

__all__ = [
    "PythonEnv", "TemplateError", "TritonBinary", "TritonNotFound", "TritonProcess", "TritonStartError",
    "find_tritonserver", "free_port", "model_names", "render_repository", "render_template",
    "server_environment", "stage_backend_directory",
]
