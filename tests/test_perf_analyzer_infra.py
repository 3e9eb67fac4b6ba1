"""perf_analyzer, as installed by perf/install_perf_analyzer.sh, runs and can stream from a decoupled model."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from triton_harness import ECHO_VALUES, TEST_MODELS, metric_value, scrape, server_fixture

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WRAPPER = REPO_ROOT / "build" / "perf_analyzer" / "bin" / "perf_analyzer"

pa_echo_server = server_fixture(TEST_MODELS, {"echo_stream": ECHO_VALUES}, ["echo_stream"])


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    path = Path(os.environ.get("PERF_ANALYZER", DEFAULT_WRAPPER))
    if not os.access(path, os.X_OK):
        pytest.skip(f"perf_analyzer not installed at {path}: run perf/install_perf_analyzer.sh "
                    "(or set PERF_ANALYZER to its wrapper)")
    return path


def test_perf_analyzer_runs(perf_analyzer):
    out = subprocess.run([str(perf_analyzer), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Perf Analyzer Version" in out.stdout + out.stderr


def test_perf_analyzer_streams_from_a_decoupled_model(perf_analyzer, request, tmp_path):
    server = request.getfixturevalue("pa_echo_server")  # started only when perf_analyzer is there
    data = tmp_path / "input.json"
    data.write_text(json.dumps({"data": [{"text": ["hello"], "n": [4]}, {"text": ["héllo wörld"], "n": [2]}]}))
    before = metric_value(scrape(server.metrics_url), "echo_stream_responses_total") or 0.0
    cmd = [str(perf_analyzer), "-m", "echo_stream", "-i", "grpc", "--streaming", "-u", server.grpc_url,
           "--input-data", str(data), "--concurrency-range", "1",
           "--measurement-mode", "count_windows", "--measurement-request-count", "10",
           "--stability-percentage", "999", "-f", str(tmp_path / "report.csv")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Detected decoupled model" in out.stdout
    assert (tmp_path / "report.csv").read_text().startswith("Concurrency,")
    assert metric_value(scrape(server.metrics_url), "echo_stream_responses_total") > before
