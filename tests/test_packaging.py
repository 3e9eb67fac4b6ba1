"""The wheel is complete: built from the sources pyproject.toml names, installed into a scratch folder, and
used from outside the checkout, every public module imports from the wheel's copy, every console script
and `cosyvoice_triton.commands` entry point loads, and the files `serve` and `up` read at run time (the
model repository templates, the web page, the default voice) are in it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)

# Runs in a fresh interpreter with only the wheel's install (and the environment's dependencies) to import
# from: prints what it found as JSON.
PROBE = r"""
import importlib, importlib.metadata, json, pkgutil, sys
import cosyvoice_triton

modules, failed = {}, {}
for info in pkgutil.walk_packages(cosyvoice_triton.__path__, "cosyvoice_triton.", onerror=lambda name: None):
    if info.name.rsplit(".", 1)[-1].startswith("_") and not info.ispkg:
        continue  # private modules (and __main__) are not public
    try:
        modules[info.name] = importlib.import_module(info.name).__file__
    except Exception as exc:
        failed[info.name] = f"{type(exc).__name__}: {exc}"
dist = importlib.metadata.distribution("cosyvoice-triton")
entries = {}
for entry in dist.entry_points:
    if entry.group in ("console_scripts", "cosyvoice_triton.commands"):
        loaded = entry.load()
        entries[f"{entry.group}:{entry.name}"] = sys.modules[loaded.__module__].__file__
from cosyvoice_triton.server.launcher import DEFAULT_REPOSITORY
from cosyvoice_triton.gateway.config import STATIC_DIR
from cosyvoice_triton.gateway.default_voice import RECORDING
print(json.dumps({"root": cosyvoice_triton.__file__, "modules": modules, "failed": failed, "entries": entries,
                  "dist": str(dist.locate_file("")),
                  "data": {"repository": str(DEFAULT_REPOSITORY), "static": str(STATIC_DIR),
                           "recording": str(RECORDING)}}))
"""


def copy_sources(out: Path) -> Path:
    """pyproject.toml, README.md and every folder its package-dir maps, copied to `out` (so the build writes
    its build/ and egg-info there, not into the checkout)."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, out / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for folder in folders:
        shutil.copytree(REPO_ROOT / folder, out / folder, ignore=ignore)
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The wheel installed into a scratch target, and what PROBE saw there."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = copy_sources(tmp_path_factory.mktemp("source"))
    wheels, target, elsewhere = tmp / "wheels", tmp / "target", tmp / "cwd"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
                   check=True, capture_output=True, timeout=240)
    (wheel,) = wheels.glob("cosyvoice_triton-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    # Only the target and the environment's site-packages: no editable finder that maps back to the checkout.
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONNOUSERSITE": "1"}
    run = subprocess.run([sys.executable, "-S", "-c", _with_site_packages(PROBE, target)], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    return {"target": target, **json.loads(run.stdout.strip().splitlines()[-1])}


def _with_site_packages(code: str, target: Path) -> str:
    """`code` run under `python -S`: the target first, then the environment's site-packages without its
    .pth files (the editable install is a .pth file), so nothing maps imports to the checkout."""
    import sysconfig

    paths = [str(target), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return f"import sys\nsys.path[:0] = {paths!r}\n" + code


def files_in(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def under(path: str, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def test_every_public_module_imports_from_the_wheel(installed):
    target, modules = installed["target"], installed["modules"]
    assert installed["failed"] == {}
    assert under(installed["root"], target)
    for package in ("models", "engines", "random_folder", "llm", "token2wav", "voices", "pipeline", "triton", "server",
                    "client", "gateway", "perf"):
        assert f"cosyvoice_triton.{package}" in modules, sorted(modules)
    assert "cosyvoice_triton.engines.onnx_export" in modules and "cosyvoice_triton.gateway.up" in modules
    outside = {name: path for name, path in modules.items() if not under(path, target)}
    assert outside == {}


def test_every_package_of_the_tree_is_listed_in_pyproject():
    """A new folder with an `__init__.py` under a mapped folder must be in pyproject's `packages`, or the
    wheel silently leaves it out."""
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (REPO_ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO_ROOT / folder).parts
            found.add(".".join([package, *parts]))
    assert found - set(setuptools["packages"]) == set()


def test_every_entry_point_loads_from_the_wheel(installed):
    entries = installed["entries"]
    assert set(entries) == {"console_scripts:cosyvoice-triton", "console_scripts:cosyvoice-client",
                            "cosyvoice_triton.commands:up", "cosyvoice_triton.commands:bench",
                            "cosyvoice_triton.commands:bench-official"}
    assert all(under(path, installed["target"]) for path in entries.values()), entries


def test_the_wheel_carries_what_serve_and_up_read(installed):
    target, data = installed["target"], installed["data"]
    repository = Path(data["repository"])
    assert under(str(repository), target)
    shipped, carried = files_in(REPO_ROOT / "model_repository"), files_in(repository)
    assert carried == shipped and "llm/config.pbtxt" in carried and "llm/1/model.py" in carried
    static = Path(data["static"])
    assert under(str(static), target) and (static / "index.html").is_file()
    assert {p.name for p in static.iterdir()} == {p.name for p in (REPO_ROOT / "gateway" / "static").iterdir()}
    assert under(data["recording"], target) and Path(data["recording"]).stat().st_size > 0
