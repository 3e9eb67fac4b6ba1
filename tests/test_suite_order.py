"""The suite's own scheduling (tests/conftest.py): modules ordered longest first for the two xdist workers,
and the seconds they took recorded for the next order."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import conftest

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Item:
    nodeid: str


def test_modules_run_longest_first_each_whole_and_in_its_own_order(tmp_path, monkeypatch):
    seconds = tmp_path / "module_seconds.json"
    seconds.write_text(json.dumps({"tests/test_b.py": 90.0, "tests/test_c.py": 5.0}))
    monkeypatch.setattr(conftest, "MODULE_SECONDS", seconds)
    items = [Item(n) for n in ("tests/test_a.py::one", "tests/test_a.py::two", "tests/test_b.py::one",
                               "tests/test_b.py::two[x]", "tests/test_c.py::one", "tests/test_d.py::one")]
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == [
        "tests/test_b.py::one", "tests/test_b.py::two[x]",  # 90 s
        "tests/test_c.py::one",  # 5 s
        "tests/test_a.py::one", "tests/test_a.py::two", "tests/test_d.py::one"]  # not listed: 0 s, as collected


def test_a_recording_run_on_two_workers_writes_every_modules_seconds(tmp_path):
    """A real pytest run under xdist, in a folder of its own with this conftest: the controller sums the
    workers' reports per module and writes them, longest first."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text((REPO_ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "tests" / "test_slow.py").write_text("import time\n\ndef test_one():\n    time.sleep(0.6)\n\n"
                                                     "def test_two():\n    time.sleep(0.6)\n")
    (tmp_path / "tests" / "test_quick.py").write_text("def test_one():\n    pass\n")
    env = {**os.environ, "COSYVOICE_RECORD_MODULE_SECONDS": "1", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadscope", "--no-loadscope-reorder", "tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = json.loads((tmp_path / "tests" / "module_seconds.json").read_text())
    assert list(recorded) == ["tests/test_slow.py", "tests/test_quick.py"]
    assert recorded["tests/test_slow.py"] >= 1.2  # both tests' calls, from both reports' durations
