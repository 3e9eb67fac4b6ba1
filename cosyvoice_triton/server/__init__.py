"""Triton plumbing: find `tritonserver`, fill config templates, run server processes.

`binary` finds the executable and stages the Python backend; `templates` renders `config.pbtxt`
templates into a run folder; `python_env` describes the Python environment the models import from and
the server environment that makes the Python backend's stubs run it (its docstring records what they
need); `process` starts and stops a server. (The stand-in for
`triton_python_backend_utils` that unit-tests a `model.py` without Triton is tests/pb_fake.py.)
"""
from __future__ import annotations

from cosyvoice_triton.server.binary import TritonBinary, TritonNotFound, find_tritonserver, stage_backend_directory
from cosyvoice_triton.server.process import TritonProcess, TritonStartError, free_port
from cosyvoice_triton.server.python_env import PythonEnv, server_environment
from cosyvoice_triton.server.templates import TemplateError, model_names, render_repository, render_template

__all__ = [
    "PythonEnv", "TemplateError", "TritonBinary", "TritonNotFound", "TritonProcess", "TritonStartError",
    "find_tritonserver", "free_port", "model_names", "render_repository", "render_template",
    "server_environment", "stage_backend_directory",
]
