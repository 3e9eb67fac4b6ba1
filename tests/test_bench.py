"""`cosyvoice-triton bench`: the report pieces, and `bench --start --quick` end to end on a real tritonserver
(tiny random model, free ports). No timing assertions: only that each level ran and the report was written."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from cosyvoice_triton.perf import loadgen, report, scenarios

REPO = Path(__file__).resolve().parents[1]


def test_percentile_nearest_rank():
    values = [0.5, 0.1, 0.3, 0.2, 0.4]
    assert loadgen.percentile(values, 50) == 0.3
    assert loadgen.percentile(values, 99) == 0.5
    assert loadgen.percentile([], 50) is None


def test_scenarios_fit_their_description():
    fast = scenarios.build("fast_clone")
    assert all(len(case.text) <= 10 and case.prompt_seconds <= scenarios.MAX_PROMPT_S for case in fast.cases)
    cross = scenarios.build("cross_lingual", quick=True)
    assert all(case.mode == "cross_lingual" for case in cross.cases)
    assert len(scenarios.build("long_text").cases[0].text) > 100


def test_report_from_synthetic_levels(tmp_path):
    levels = [loadgen.LevelResult(c, 1.0, [loadgen.RequestResult(0.1 * c, 0.2 * c, 0.5, 2.0, 3),
                                           loadgen.RequestResult(error="TTSError: busy")]) for c in (1, 2)]
    paths = report.write([level.summary() for level in levels], report.environment(scenario="fast_clone"), tmp_path)
    text = paths["markdown"].read_text()
    assert "| 1 | 2 | 1 | 100 /" in text and "| 2 | 2 | 1 | 200 /" in text and "TTSError: busy" in text
    assert paths["first_chunk_png"].stat().st_size > 0 and paths["rtf_png"].stat().st_size > 0


def test_perf_analyzer_sweep_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "perf" / "perf_analyzer_sweep.sh")], check=True)


def test_bench_start_quick_end_to_end(tiny_model_dir, tmp_path, capsys):
    from triton_harness import tritonserver_or_skip

    from cosyvoice_triton.cli import main

    tritonserver_or_skip()
    out = tmp_path / "report"
    code = main(["bench", "--start", "--quick", "--model-dir", str(tiny_model_dir), "--warmup", "0",
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "concurrency   1:" in printed and "concurrency   2:" in printed  # one progress line per level
    rows = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]
    results = json.loads((out / "results.json").read_text())
    assert [level["requests"] for level in results["levels"]] == [2, 2]
    assert all(level["errors"] == 0 and level["audio_s"] > 0 for level in results["levels"])
    for name in ("first_chunk.png", "rtf_throughput.png"):
        assert (out / name).stat().st_size > 0
