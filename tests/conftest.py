"""Shared fixtures. The golden set travels with the repository in tests/golden/ (its README lists every array)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

# The golden outputs were computed with 2 CPU threads; thread count barely matters, but keep it fixed.
TORCH_THREADS = 2
torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_at_module_start():
    """Every module starts with TORCH_THREADS in the main thread, whatever the modules before it in this process
    left (a core share or thread plan run here sets the calling thread's count): a thread count changes float
    sums, and a batched-vs-solo token comparison can then sample one token differently (seen at 4 threads).
    A module's own fixtures may still set their count for the module (the references at one thread)."""
    from cosyvoice_triton.pipeline.threads import set_torch_threads

    set_torch_threads(TORCH_THREADS)  # also what it remembers having set for this thread
    torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): as the CosyVoice3
    golden outputs were made, and because two threads on cores that other processes keep busy can stall
    (measured: a tiny DiT stream 0.6 s at one thread, 37 s at two)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(TORCH_THREADS)


# Strict mode (`./run.sh test` and CI turn it on): a test that skips because a real component is missing
# (tritonserver, redis-server, chromium, perf_analyzer, the golden folder, a test dependency) fails
# instead, so a green run means every feature was exercised. Skips a user asks for by name
# (COSYVOICE_SKIP_*) stay skips.
STRICT = os.environ.get("COSYVOICE_STRICT_TESTS") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and "COSYVOICE_SKIP_" not in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"skipped in strict mode (COSYVOICE_STRICT_TESTS=1): {report.longrepr}"


def golden_dir() -> Path:
    return Path(os.environ.get("COSYVOICE_GOLDEN_DIR", REPO_ROOT / "tests" / "golden" / "tiny"))


@pytest.fixture(scope="session")
def golden_path() -> Path:
    path = golden_dir()
    if not (path / "golden.npz").exists():
        pytest.skip(f"golden set not found at {path} (set COSYVOICE_GOLDEN_DIR)")
    return path


@pytest.fixture(scope="session")
def golden(golden_path: Path) -> dict[str, np.ndarray]:
    with np.load(golden_path / "golden.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="session")
def golden_meta(golden_path: Path) -> dict:
    return json.loads((golden_path / "golden.json").read_text())


@pytest.fixture(scope="session")
def golden_model_dir(golden_path: Path) -> Path:
    return golden_path / "model"


@pytest.fixture(scope="module")
def flow(golden_model_dir):
    """The golden folder's flow (torch), loaded once per test module."""
    from cosyvoice_triton.models.flow import FlowModel

    return FlowModel.from_model_dir(golden_model_dir)


@pytest.fixture(scope="module")
def hift(golden_model_dir):
    """The golden folder's HiFT vocoder (torch), loaded once per test module."""
    from cosyvoice_triton.models.hift import HiFTGenerator

    return HiFTGenerator.from_model_dir(golden_model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random model folder in the released layout, written once per test session."""
    from cosyvoice_triton.random_folder.write import write_random_model

    return write_random_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def prompt_wav_16k() -> tuple[np.ndarray, int]:
    """A speech-like 3 s prompt recording at 16 kHz, made locally."""
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    return speech_like(3.0, 16000, seed=0), 16000


# Longest module first. `./run.sh test` hands whole modules to two xdist workers in the order collected
# (--dist loadscope --no-loadscope-reorder); a long module taken last would leave one worker alone for minutes
# at the end. The seconds are those of a measured run (MODULE_SECONDS, written by a run with
# COSYVOICE_RECORD_MODULE_SECONDS=1); a module it does not list counts as 0 s (it runs among the short ones).
MODULE_SECONDS = REPO_ROOT / "tests" / "module_seconds.json"
RECORD_SECONDS = os.environ.get("COSYVOICE_RECORD_MODULE_SECONDS") == "1"
_recorded: dict[str, float] = {}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items):
    seconds = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}
    items.sort(key=lambda item: -seconds.get(module_of(item.nodeid), 0.0))  # stable: a module keeps its order


def pytest_runtest_logreport(report):
    """Runs in the process that reports (the xdist controller, or the only process): every worker's tests."""
    if RECORD_SECONDS:
        _recorded[module_of(report.nodeid)] = _recorded.get(module_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """Stop the tritonservers that modules shared (tests/web/stack.py), so none outlives the run; write the
    modules' seconds when asked (the controller only: a worker saw its own modules)."""
    import sys

    stack = sys.modules.get("web.stack")
    if stack is not None:
        stack.stop_shared_servers()
    if RECORD_SECONDS and _recorded and not hasattr(session.config, "workerinput"):
        ordered = dict(sorted(((m, round(s, 1)) for m, s in _recorded.items()), key=lambda kv: -kv[1]))
        MODULE_SECONDS.write_text(json.dumps(ordered, indent=1) + "\n")
