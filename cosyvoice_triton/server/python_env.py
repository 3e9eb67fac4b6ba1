"""The Python environment that the Python-backend stubs run, and the server environment that makes
them run it (found by running the pytriton 0.7.0 binary, Triton 2.51, and reading python_backend's stub
launcher):

* **The stub.** Each model instance is a separate process,
  `<backend-directory>/python/triton_python_backend_stub`, started through `bash -c "exec <stub> ..."`
  with tritonserver's own environment (or, if present, `<model folder>/triton_python_backend_stub`).
  The stub embeds CPython: it must be built for the same `X.Y` as the environment the models run in.
  `binary.stage_backend_directory` puts the right one in place.
* **libpython.** The stub links `libpython3.Y.so.1.0` dynamically. We put the folder of the
  environment's *own* shared libpython (`sysconfig` `LIBDIR`, e.g. pyenv's
  `~/.pyenv/versions/3.11.7/lib`) first on `LD_LIBRARY_PATH`, so the stub runs the same build as the
  environment's standard library. Without it the loader falls back to the system one (Debian/Ubuntu:
  apt package `libpython3.11`), which works within one minor version but mixes patch releases.
  A Python built without a shared library (`Py_ENABLE_SHARED=0`) needs that system package.
* **The environment.** The embedded interpreter finds its prefix by looking up `python3` on `PATH`
  (the stub does not set a program name), and then reads `pyvenv.cfg` beside it. So putting
  `<env>/bin` first on `PATH` makes `sys.prefix` the venv, its `site-packages` the import path, and its
  `.pth` files run, which is what makes an editable install (`pip install -e .`, an import hook in a
  `.pth` file) importable. `PYTHONPATH` alone would not run `.pth` files. This is also what pytriton
  does, and what python_backend's `EXECUTION_ENV_PATH` does (it sources `<env>/bin/activate`).
  `PYTHONHOME` is dropped: it would override the lookup.
"""
from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_triton.server.binary import TritonBinary, TritonNotFound


@dataclass(frozen=True)
class PythonEnv:
    """The Python environment (venv, conda env or base install) whose packages the models import."""

    prefix: Path  # sys.prefix
    bin_dir: Path  # holds `python3`; goes first on PATH
    version: str  # "3.11"
    libpython_dir: Path | None  # folder holding the environment's shared libpython, if it has one
    libpython_name: str  # "libpython3.11.so.1.0"

    @classmethod
    def current(cls) -> "PythonEnv":
        """The environment of the running interpreter."""
        return cls._from_info(_python_info())

    @classmethod
    def from_prefix(cls, prefix: str | Path) -> "PythonEnv":
        """Another environment, by its prefix (the folder holding `bin/python3`)."""
        python = Path(prefix) / "bin" / "python3"
        if not python.exists():
            raise TritonNotFound(f"{python} does not exist: not a Python environment")
        # a self-contained probe: the other environment need not have this package
        code = _PROBE_SOURCE + "\nimport json\nprint(json.dumps(_probe()))\n"
        out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
        return cls._from_info(json.loads(out.stdout))

    @classmethod
    def _from_info(cls, info: dict) -> "PythonEnv":
        libdir = Path(info["libdir"]) if info["libdir"] else None
        name = info["instsoname"] or f"libpython{info['version']}.so.1.0"
        if libdir is not None and not (libdir / name).exists():
            libdir = None
        prefix = Path(info["prefix"])
        return cls(prefix=prefix, bin_dir=prefix / "bin", version=info["version"],
                   libpython_dir=libdir, libpython_name=name)

    def check_libpython(self) -> None:
        """Fail early when the stub could not load any libpython of this version."""
        if self.libpython_dir is None and ctypes.util.find_library(f"python{self.version}") is None:
            raise TritonNotFound(
                f"no shared libpython{self.version} for the Python backend stub: this Python has none, "
                f"and the system has none (Debian/Ubuntu: apt-get install libpython{self.version})")


# Describes the interpreter that runs it; run in-process for the current environment, and with the
# other environment's python for `PythonEnv.from_prefix` (so that one needs nothing installed).
_PROBE_SOURCE = """
import sys, sysconfig

def _probe():
    shared = sysconfig.get_config_var("Py_ENABLE_SHARED")
    return {"prefix": sys.prefix, "version": "%d.%d" % sys.version_info[:2],
            "libdir": sysconfig.get_config_var("LIBDIR") if shared else None,
            "instsoname": sysconfig.get_config_var("INSTSONAME")}
"""


def _python_info() -> dict:
    namespace: dict = {}
    exec(_PROBE_SOURCE, namespace)  # noqa: S102 - our own constant
    return namespace["_probe"]()


def server_environment(binary: TritonBinary, python_env: PythonEnv, *, pythonpath: Sequence[str | Path] = (),
                       extra: Mapping[str, str] | None = None,
                       base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for tritonserver so that its stubs run `python_env` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONHOME", None)
    env["PATH"] = _prepend(str(python_env.bin_dir), env.get("PATH", os.defpath))
    if (python_env.prefix / "pyvenv.cfg").exists():
        env["VIRTUAL_ENV"] = str(python_env.prefix)
    ld = env.get("LD_LIBRARY_PATH", "")
    if python_env.libpython_dir is not None:
        ld = _prepend(str(python_env.libpython_dir), ld)
    env["LD_LIBRARY_PATH"] = ld
    env = binary.environment(env)
    for item in reversed([str(p) for p in pythonpath]):
        env["PYTHONPATH"] = _prepend(item, env.get("PYTHONPATH", ""))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def _prepend(item: str, path: str) -> str:
    rest = [p for p in path.split(os.pathsep) if p and p != item]
    return os.pathsep.join([item, *rest])
