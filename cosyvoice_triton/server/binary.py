"""Find a `tritonserver` executable and what it needs to run our Python-backend models.

Where it looks, first hit wins:

1. `$TRITONSERVER`: a path to the executable (any install laid out as `<root>/bin/tritonserver`
   with `<root>/backends/` beside it, as in the NGC container).
2. The binary inside the `nvidia-pytriton` wheel: `pytriton/tritonserver/bin/tritonserver`. Its shared
   libraries (renamed with a hash, e.g. `libtritonserver-717102f0.so`) live in the wheel's
   `nvidia_pytriton.libs/` folder, found through the binary's RPATH and, as pytriton itself does, also
   through `LD_LIBRARY_PATH`. Its `backends/python/` holds `libtriton_python.so` and
   `triton_python_backend_utils.py` but *no* stub: the stubs are in `python_backend_stubs/<X.Y>/`, one per
   Python version, and must be copied next to `libtriton_python.so` (the backend starts
   `<backend-directory>/python/triton_python_backend_stub`). So the backends are staged into a folder
   of our own and passed with `--backend-directory` (see `stage_backend_directory`).
3. `tritonserver` on `PATH`, then `/opt/tritonserver/bin/tritonserver` (NGC container). There the stub
   ships inside `backends/python/` and is built for the container's own Python; `stage_backend_directory`
   refuses a stub built for another Python version than the environment that must run the models.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from cosyvoice_triton.errors import TritonNotFound

ENV_VAR = "TRITONSERVER"
NGC_EXECUTABLE = Path("/opt/tritonserver/bin/tritonserver")
STUB_NAME = "triton_python_backend_stub"
_LIBPYTHON_RE = re.compile(rb"libpython(3\.\d+)\.so")


@dataclass(frozen=True)
class TritonBinary:
    """A `tritonserver` install: the executable, its backends and the libraries it needs.

    `stubs_dir` is set for the pytriton layout (`<stubs_dir>/<X.Y>/triton_python_backend_stub`);
    otherwise the stub is the one inside `backend_dir/python/`.
    """

    executable: Path
    backend_dir: Path
    source: str  # "env", "pytriton" or "path"
    library_dirs: tuple[Path, ...] = ()
    stubs_dir: Path | None = None
    cache_dir: Path | None = None

    def command(self, *args: str) -> list[str]:
        return [str(self.executable), *args]

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) with the binary's library folders appended
        to `LD_LIBRARY_PATH` (appended, so that whatever the caller put first still wins)."""
        env = dict(os.environ if base is None else base)
        extra = [str(p) for p in self.library_dirs]
        if extra:
            env["LD_LIBRARY_PATH"] = _join_paths(env.get("LD_LIBRARY_PATH", ""), *extra)
        return env

    def stub_path(self, python_version: str) -> Path:
        """The Python backend stub for `python_version` ("3.11")."""
        if self.stubs_dir is not None:
            stub = self.stubs_dir / python_version / STUB_NAME
            if not stub.is_file():
                have = sorted(p.name for p in self.stubs_dir.iterdir() if (p / STUB_NAME).is_file())
                raise TritonNotFound(
                    f"no Python backend stub for Python {python_version} in {self.stubs_dir} (have: {have})")
            return stub
        stub = self.backend_dir / "python" / STUB_NAME
        if not stub.is_file():
            raise TritonNotFound(f"{stub} is missing: this tritonserver has no Python backend stub")
        built_for = stub_python_version(stub)
        if built_for is not None and built_for != python_version:
            raise TritonNotFound(
                f"{stub} is built for Python {built_for}, but the models must run with Python {python_version}. "
                f"Run the server from a Python {built_for} environment, or build a stub for {python_version} "
                "(python_backend, -DPYBIND11_PYTHON_VERSION) and put it in the model folder.")
        return stub


def stub_python_version(stub: Path) -> str | None:
    """The `X.Y` of the libpython that a stub binary links against, read from its bytes."""
    match = _LIBPYTHON_RE.search(stub.read_bytes())
    return match.group(1).decode() if match else None


def stage_backend_directory(binary: TritonBinary, dst: str | Path, python_version: str | None = None) -> Path:
    """Lay out a `--backend-directory` at `dst` whose `python/` backend has the stub for `python_version`.

    Returns `binary.backend_dir` itself when its own stub already fits (NGC layout, matching Python);
    otherwise copies `python/` (about 3 MB) into `dst`, adds the stub, and links every other backend.
    """
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = binary.stub_path(version)
    if binary.stubs_dir is None:
        return binary.backend_dir
    dst = Path(dst)
    python_dst = dst / "python"
    python_dst.mkdir(parents=True, exist_ok=True)
    for item in (binary.backend_dir / "python").iterdir():
        if item.is_file():
            shutil.copy2(item, python_dst / item.name)
    shutil.copy2(stub, python_dst / STUB_NAME)
    for other in binary.backend_dir.iterdir():
        if other.name != "python" and other.is_dir() and not (dst / other.name).exists():
            (dst / other.name).symlink_to(other, target_is_directory=True)
    return dst


def find_tritonserver() -> TritonBinary:
    """The first `tritonserver` found (see the module docstring); `TritonNotFound` if none is."""
    tried: list[str] = []
    env_value = os.environ.get(ENV_VAR)
    if env_value:
        path = Path(env_value).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise TritonNotFound(f"${ENV_VAR}={env_value} is not an executable file")
        return _from_executable(path.resolve(), source="env")
    tried.append(f"${ENV_VAR} (unset)")

    pytriton = _pytriton_binary()
    if pytriton is not None:
        return pytriton
    tried.append("the nvidia-pytriton wheel (not installed)")

    on_path = shutil.which("tritonserver")
    for candidate in ([Path(on_path)] if on_path else []) + [NGC_EXECUTABLE]:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return _from_executable(candidate.resolve(), source="path")
    tried.append(f"tritonserver on PATH and {NGC_EXECUTABLE}")
    raise TritonNotFound("no tritonserver found; tried " + ", ".join(tried) +
                         ". Install the 'server' extra (nvidia-pytriton) or set $TRITONSERVER.")


def _pytriton_binary() -> TritonBinary | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    root = package / "tritonserver"
    executable = root / "bin" / "tritonserver"
    if not executable.is_file():
        return None
    # A wheel install keeps the vendored libraries beside the package; an editable one inside it.
    libs = [p for p in (package.parent / "nvidia_pytriton.libs", root / "external_libs") if p.is_dir()]
    return TritonBinary(
        executable=executable,
        backend_dir=root / "backends",
        source="pytriton",
        library_dirs=tuple(libs),
        stubs_dir=root / "python_backend_stubs",
        cache_dir=root / "caches" if (root / "caches").is_dir() else None,
    )


def _from_executable(executable: Path, source: str) -> TritonBinary:
    """An install laid out as `<root>/bin/tritonserver` with `<root>/backends` (NGC or pytriton)."""
    root = executable.parent.parent
    pytriton = _pytriton_binary()
    if pytriton is not None and pytriton.executable.resolve() == executable:
        return replace(pytriton, source=source)
    backend_dir = root / "backends"
    if not backend_dir.is_dir():
        raise TritonNotFound(f"{executable}: no backends folder at {backend_dir}")
    stubs_dir = root / "python_backend_stubs"
    return TritonBinary(
        executable=executable,
        backend_dir=backend_dir,
        source=source,
        library_dirs=tuple(p for p in (root / "lib",) if p.is_dir()),
        stubs_dir=stubs_dir if stubs_dir.is_dir() else None,
        cache_dir=root / "caches" if (root / "caches").is_dir() else None,
    )


def _join_paths(*parts: str) -> str:
    seen: list[str] = []
    for part in parts:
        for item in part.split(os.pathsep):
            if item and item not in seen:
                seen.append(item)
    return os.pathsep.join(seen)
