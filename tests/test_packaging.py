"""The wheel is complete: built from the sources pyproject.toml names, installed into a scratch folder, and
used from outside the checkout, every public module imports from the wheel's copy, every console script
and `cosyvoice_triton.commands` entry point loads, and the files `serve` and `up` read at run time (the
model repository templates, the web page, the default voice) are in it, with the licence, the version and
the type-hint markers in its metadata. And its `serve` extra, installed into a fresh virtualenv, is a server:
`serve`, the gateway and `cosyvoice-client` start, and none of the tool-only packages (plots, tests, docs) is
there. (The `client` extra alone: tests/test_client_install.py.)"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

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
    """pyproject.toml, README.md, LICENSE and every folder its package-dir maps, copied to `out` (so the build
    writes its build/ and egg-info there, not into the checkout)."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    for name in ("pyproject.toml", "README.md", *pyproject["project"]["license-files"]):
        shutil.copy2(REPO_ROOT / name, out / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for folder in folders:
        shutil.copytree(REPO_ROOT / folder, out / folder, ignore=ignore)
    return out


PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources."""
    source = copy_sources(tmp_path_factory.mktemp("source"))
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
                   check=True, capture_output=True, timeout=240)
    (built,) = wheels.glob("cosyvoice_triton-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    """The wheel installed into a scratch target, and what PROBE saw there."""
    tmp = tmp_path_factory.mktemp("packaging")
    target, elsewhere = tmp / "target", tmp / "cwd"
    elsewhere.mkdir()
    subprocess.run([*PIP, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
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


def test_the_wheel_carries_its_licence_version_and_type_markers(wheel):
    import zipfile

    import cosyvoice_triton

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        fields = archive.read(metadata).decode()
        licence = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert archive.read(licence) == (REPO_ROOT / "LICENSE").read_bytes()
    assert "Apache License\n                           Version 2.0" in (REPO_ROOT / "LICENSE").read_text()
    assert "License-Expression: Apache-2.0" in fields.splitlines()
    assert f"Version: {cosyvoice_triton.__version__}" in fields.splitlines()
    assert {"cosyvoice_triton/py.typed", "cosyvoice_triton/client/py.typed"} <= names
    assert {"Provides-Extra: client", "Provides-Extra: serve"} <= set(fields.splitlines())


# ---- the serve extra -------------------------------------------------------------------------------------

# Extras of tools, not of serving: no public module may need their packages to import, and none of them
# (nor the `train` extra's) may be a base or `serve` dependency.
TOOL_EXTRAS = ("bench", "test", "docs")
# Import names of tool-only packages that a server install must not bring, even through one of its dependencies
# (geventhttpclient: tritonclient's HTTP client, which `tritonclient[all]` would pull in).
ABSENT = {"matplotlib": "bench", "pytest": "test", "grpc_tools": "test", "geventhttpclient": "test",
          "mkdocs": "docs", "peft": "train"}

# Runs in the fresh venv: which ABSENT packages import, each public module that does not import (with the
# name of the module it missed), what asking for a plot says, and the distribution's requirements.
FRESH_PROBE = r"""
import importlib, importlib.metadata, json, pkgutil, sys
import cosyvoice_triton

absent = json.loads(sys.argv[1])
imported = []
for name in absent:
    try:
        importlib.import_module(name)
        imported.append(name)
    except ImportError:
        pass
failed = {}
for info in pkgutil.walk_packages(cosyvoice_triton.__path__, "cosyvoice_triton.", onerror=lambda name: None):
    if info.name.rsplit(".", 1)[-1].startswith("_") and not info.ispkg:
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        failed[info.name] = (exc.name or "").split(".")[0]
    except Exception as exc:
        failed[info.name] = f"{type(exc).__name__}: {exc}"
from cosyvoice_triton.perf import report
try:
    report.pyplot()
    plots = "drawn"
except ModuleNotFoundError as exc:
    plots = str(exc)
print(json.dumps({"imported": imported, "failed": failed, "plots": plots, "root": cosyvoice_triton.__file__,
                  "requires": importlib.metadata.distribution("cosyvoice-triton").requires}))
"""


def import_name(requirement: str) -> str:
    """The module a requirement installs, for the packages of pyproject's extras (`nvidia-pytriton` aside)."""
    return re.sub(r"[-.]", "_", Requirement(requirement).name).lower()


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """The wheel with its base dependencies, the `serve` extra and the `cpu` extra's torch pin; torch comes
    from the machine's local wheel folder, as in scripts/setup.sh."""
    return new_venv(tmp_path_factory.mktemp("fresh") / "venv", f"cosyvoice-triton[serve,cpu] @ {wheel.as_uri()}")


def new_venv(venv: Path, requirement: str, timeout_s: float = 1500) -> Path:
    """A virtualenv at `venv`, without system site packages, holding `requirement`. pip resolves it from the
    package registry and keeps its cache (a second run downloads nothing)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    # --no-compile: byte-compiling torch's thousands of files at install would take longer than the imports after
    run = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q", "install",
                          "--no-compile", requirement],
                         env=fresh_env(), capture_output=True, text=True, timeout=timeout_s, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return venv


def fresh_env() -> dict:
    """This environment less what points into the dev venv or the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**env, "PYTHONNOUSERSITE": "1"}


@pytest.mark.timeout(1800)  # a first run installs torch and the server's dependencies into a new venv (minutes)
def test_the_serve_extra_is_a_server_without_tool_packages(fresh_venv, tmp_path):
    bin_dir = fresh_venv / "bin"
    for command in ([bin_dir / "cosyvoice-triton", "serve", "--help"], [bin_dir / "cosyvoice-triton", "up", "--help"],
                    [bin_dir / "python", "-m", "cosyvoice_triton.gateway", "--help"],
                    [bin_dir / "cosyvoice-client", "--help"]):
        run = subprocess.run([str(part) for part in command], cwd=tmp_path, env=fresh_env(), capture_output=True,
                             text=True, timeout=240, check=False)
        assert run.returncode == 0 and "usage:" in run.stdout, (command, run.stdout[-2000:], run.stderr[-2000:])

    probe = subprocess.run([str(bin_dir / "python"), "-c", FRESH_PROBE, json.dumps(sorted(ABSENT))], cwd=tmp_path,
                           env=fresh_env(), capture_output=True, text=True, timeout=300, check=False)
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-2000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert under(seen["root"], fresh_venv)
    assert seen["imported"] == [], {name: f"in the {ABSENT[name]} extra" for name in seen["imported"]}
    assert "pip install 'cosyvoice-triton[bench]'" in seen["plots"]

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {extra: {import_name(req) for req in reqs} for extra, reqs in extras.items()}
    # A public module may miss a package of a feature's extra (train's peft, ...), never a tool's, the base's or
    # the serve extra's.
    features = set().union(*(found for extra, found in names.items() if extra not in (*TOOL_EXTRAS, "serve")))
    assert {module: name for module, name in seen["failed"].items() if name not in features} == {}

    base = [Requirement(r) for r in seen["requires"] if "extra ==" not in r]
    server = base + [Requirement(r) for r in extras["serve"]]
    assert "matplotlib" in names["bench"] and "torch" in names["serve"] and "torch" not in {r.name for r in base}
    # `tritonclient[http]` in `test` moves tritonclient's HTTP extra, not tritonclient.
    moved = {import_name(req) for extra in (*TOOL_EXTRAS, "train") for req in extras[extra] if "[" not in req}
    assert {import_name(str(r)) for r in server} & moved == set(), "a tool-only package is a server dependency"
    assert all(r.extras <= {"grpc"} for r in server if r.name == "tritonclient")
