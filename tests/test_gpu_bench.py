"""`perf/gpu_bench.py`, the GPU mode of the benchmark, run on the CPU: the quick run end to end (tiny random
model, levels 1 and 2), a CosyVoice3 run with its stage profile (perf/gpu_stages.py), the same run as on the
GPU image (no wetext, no soundfile), the token2wav batcher against a fake engine, and the report of skipped
levels and targets. No timing assertions."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.perf import gpu_bench
from cosyvoice_triton.pipeline.local_stages import BatchingToken2WavStage
from cosyvoice_triton.token2wav.scheduler import ChunkRequest
from polling import wait_until

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)  # a deadlock fails the test instead of hanging the session


def table_rows(report: str) -> list[list[str]]:
    """The cells of the report's level rows (those whose first cell is a number)."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in report.splitlines()
            if line.startswith("| ")]
    return [row for row in rows if row[0].isdigit()]


def test_quick_cpu_run_writes_a_report_per_level(tmp_path):
    threads = torch.get_num_threads()  # --quick sets one torch thread for the run
    try:
        code = gpu_bench.main(["--device", "cpu", "--size", "tiny", "--quick", "--family", "cosyvoice2",
                               "--stage-profile", "off", "--work-dir", str(tmp_path / "work"),
                               "--out", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    (scenario,) = results["scenarios"]
    assert scenario["name"] == "fast_clone" and scenario["skipped"] == []
    levels = scenario["levels"]
    assert [(s["concurrency"], s["requests"], s["errors"]) for s in levels] == [(1, 2, 0), (2, 2, 0)]
    assert all(s["audio_s"] > 0 and s["first_chunk_p50_s"] is not None for s in levels)
    assert all(s["first_audible_p50_s"] >= s["first_chunk_p50_s"] for s in levels)  # heard no sooner than sent
    report = (tmp_path / "out" / "report.md").read_text()
    assert [row[:3] for row in table_rows(report)] == [["1", "2", "0"], ["2", "2", "0"]]
    assert "## Targets (reported, not asserted)" in report and "max speech tokens per text token 3" in report
    assert (tmp_path / "out" / "fast_clone.png").stat().st_size > 0


def test_a_cosyvoice3_run_has_its_levels_and_stage_sections(tmp_path):
    """Each family on a random folder of its own; after its levels, one stream's stages (the LLM steps, the
    DiT flow calls and the causal vocoder's windowed calls) and the side by side, which says in its place why
    it did not run."""
    threads = torch.get_num_threads()
    try:
        code = gpu_bench.main(["--device", "cpu", "--size", "tiny", "--quick", "--family", "cosyvoice3",
                               "--concurrency", "1", "--requests", "1", "--warmup", "0",
                               "--official-src", str(tmp_path / "official"), "--work-dir", str(tmp_path / "work"),
                               "--out", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    assert (tmp_path / "work" / "cosyvoice3-tiny" / "cosyvoice3.yaml").is_file()
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    [scenario] = results["scenarios"]
    assert [(s["concurrency"], s["requests"], s["errors"]) for s in scenario["levels"]] == [(1, 1, 0)]
    assert scenario["levels"][0]["audio_s"] > 0
    profile, official = results["stages"]
    assert profile["title"] == "cosyvoice3: where one stream's time goes"
    assert "exactly 30 speech tokens" in profile["markdown"]
    stages = {row[0]: row[1] for row in (line.strip("|").split("|") for line in profile["markdown"].splitlines())
              if len(row) == 4}
    assert all(int(stages[f" {stage} "]) >= 1 for stage in ("prefill", "decode", "flow", "hift")), stages
    assert official["title"] == "cosyvoice3: side by side with the official code"
    assert official["markdown"].startswith("Not run: ValueError: --official-src needs --official-venv")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## cosyvoice3: where one stream's time goes" in report and "cosyvoice3, tiny random weights" in report


GPU_IMAGE = """
import sys
for name in ("wetext", "soundfile", "tritonclient"):  # missing on the GPU image: importing them fails
    sys.modules[name] = None
from cosyvoice_triton.perf.gpu_bench import main
sys.exit(main(sys.argv[1:]))
"""


def test_runs_as_on_the_gpu_image_without_wetext_and_soundfile(tiny_model_dir, tmp_path):
    """Two variants, CUDA graphs off and on: on the CPU `on` runs eager with one warning line."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", GPU_IMAGE, "--device", "cpu", "--model-dir", str(tiny_model_dir),
                          "--quick", "--concurrency", "1", "--requests", "1", "--warmup", "0",
                          "--cuda-graphs", "off", "on", "--scenario", "cross_lingual",
                          "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                         capture_output=True, text=True, timeout=110, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    report = (out / "report.md").read_text()
    assert "wetext is not installed" in report and "soundfile is not installed" in report
    assert [row[:3] for row in table_rows(report)] == [["1", "1", "0"], ["1", "1", "0"]]
    assert "## cross_lingual (CUDA graphs off, LLM fp32)" in report
    assert "## cross_lingual (CUDA graphs on, LLM fp32)" in report
    assert "CUDA graphs need a CUDA device" in run.stderr
    assert (out / "cross_lingual-graphs-on-fp32.png").stat().st_size > 0


class FakeEngine:
    """Token2WavScheduler's run/cancel: answers each chunk with its stream id's number; the first call waits
    for `release`, so the chunks sent meanwhile queue up in the batcher."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.cancelled: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def run(self, chunks):
        self.entered.set()
        self.release.wait(timeout=30)
        self.batches.append([chunk.stream_id for chunk in chunks])
        return [ValueError("bad chunk") if chunk.stream_id == "bad" else np.full(2, float(chunk.stream_id))
                for chunk in chunks]

    def cancel(self, stream_id):
        self.cancelled.append(stream_id)


def chunk(stream_id: str) -> ChunkRequest:
    return ChunkRequest(stream_id=stream_id, tokens=[1, 2], finalize=False, prompt=None, seed=None)


@pytest.mark.parametrize("max_batch, batches", [(16, [["0"], ["1", "2", "3"]]), (2, [["0"], ["1", "2"], ["3"]])])
def test_batcher_gathers_waiting_chunks_into_one_engine_call(max_batch, batches):
    engine = FakeEngine()
    batcher = BatchingToken2WavStage(engine, max_batch=max_batch, queue_delay_s=0.0)
    got: dict[str, np.ndarray] = {}

    def send(stream_id: str) -> None:
        got[stream_id] = batcher.chunk(chunk(stream_id))

    clients = [threading.Thread(target=send, args=("0",))]
    clients[0].start()
    assert engine.entered.wait(timeout=10)  # "0" is in the engine, held there
    for stream_id in ("1", "2", "3"):
        clients.append(threading.Thread(target=send, args=(stream_id,)))
        clients[-1].start()
    wait_until(lambda: batcher._queue.qsize() == 3, timeout_s=10, interval_s=0.01)
    engine.release.set()
    for client in clients:
        client.join(timeout=10)
    batcher.close()
    assert engine.batches == batches
    assert {k: v.tolist() for k, v in got.items()} == {s: [float(s)] * 2 for s in "0123"}


def test_batcher_passes_cancels_and_per_chunk_errors():
    engine = FakeEngine()
    engine.release.set()
    batcher = BatchingToken2WavStage(engine, max_batch=4, queue_delay_s=0.0)
    batcher.cancel("7")
    with pytest.raises(ValueError, match="bad chunk"):
        batcher.chunk(chunk("bad"))
    assert batcher.chunk(chunk("5")).tolist() == [5.0, 5.0]  # the batcher goes on after an error
    batcher.close()
    assert engine.cancelled == ["7"]


def level(concurrency: int, first_p50: float, first_p99: float, rtf: float) -> dict:
    results = [gpu_bench.RequestResult(first_p50, None, 1.0, 2.0), gpu_bench.RequestResult(first_p99, None, 1.0, 2.0)]
    summary = gpu_bench.summarize(concurrency, 2, results, wall_s=4.0 * rtf, flow_batch=1.0)
    assert summary["rtf"] == pytest.approx(rtf)
    return summary


def test_report_marks_targets_and_skipped_levels(tmp_path):
    scenario = {"name": "fast_clone", "description": "short", "prompt": "speech_like, 3.0 s",
                "levels": [level(1, 0.04, 0.09, 0.05), level(16, 0.2, 0.4, 0.03)],
                "skipped": ["concurrency 64 not started: the time budget is short: about 90 s needed, 10 s left"]}
    results = {"environment": {"date": "2026-11-30", "gpu": "GPU test", "cpu_count": 2, "python": "3.12",
                               "versions": "torch"}, "settings": {"model": "tiny"}, "notes": [],
               "scenarios": [scenario]}
    report = gpu_bench.write_outputs(results, tmp_path, plots=True)
    assert "| fast_clone: first chunk p50 <= 50 ms at concurrency 1 | 40 ms | met |" in report
    assert "| fast_clone: first chunk p99 <= 250 ms at concurrency 16 | 400 ms | not met |" in report
    assert "| fast_clone: aggregate RTF <= 0.01 at concurrency 64 | - | not measured |" in report
    assert "- concurrency 64 not started: the time budget is short" in report
    assert json.loads((tmp_path / "results.json").read_text())["targets"][0]["status"] == "met"
    assert (tmp_path / "fast_clone.png").stat().st_size > 0


def test_level_estimate_is_rounds_of_the_previous_median_request():
    assert gpu_bench.estimate_s(None, 4, 16) == 0.0
    assert gpu_bench.estimate_s({"total_p50_s": 2.0}, 4, 16) == pytest.approx(8.0)  # 4 rounds of 2 s
    assert gpu_bench.estimate_s({"total_p50_s": 2.0}, 32, 40) == pytest.approx(4.0)  # 2 rounds, the last partial


def test_gpu_bench_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "perf" / "gpu_bench.sh")], check=True)
