"""perf/bench_official.py: our side's timing entry (exactly N tokens) and the report from official rounds
recorded by the tool itself (tests/data/official_rounds_tiny.json).

The real side by side needs a checkout of the official repository and a virtualenv with its packages;
making that venv takes longer than a test may, so it is a benchmark (perf/README.md, perf/RESULTS.md),
not a test.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cosyvoice_triton.perf import bench_official
from cosyvoice_triton.random_folder.write import write_random_model

pytestmark = pytest.mark.timeout(600)

DATA = Path(__file__).parent / "data"
N = 30  # speech tokens: more than the first chunk (25 + 3 lookahead with the prompt's padding)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", backbone_weights=False)


def test_our_side_alone_prints_json_of_exactly_n_tokens(model_dir: Path, capsys) -> None:
    """The pipeline with the LLM waiting while token2wav runs and with the two overlapped (the first chunk
    beside the LLM on token2wav's share, and alone on every core), interleaved."""
    bench_official.main(["--model-dir", str(model_dir), "--speech-tokens", str(N), "--text-tokens", "6",
                         "--prompt-tokens", "20", "--concurrency", "1", "--repeats", "1", "--decode-ahead", "both",
                         "--first-chunk", "both", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert (result["speech_tokens"], result["prompt_tokens"]) == (N, 20)
    assert result["text_tokens"] >= 6
    [level] = result["levels"]
    assert level["audio_s"] == pytest.approx(N / 25)  # exactly N tokens, 2 mel frames x 480 samples each
    assert 0 < level["first_audio_s"] <= level["total_s"]
    waits, overlapped = level["variants"]["in_process_llm_waits"], level["variants"]["in_process"]
    assert waits["audio_s"] == overlapped["audio_s"]
    assert level["ratios"]["in_process / in_process_llm_waits"]["total_s"] == pytest.approx(
        overlapped["total_s"] / waits["total_s"])
    shared = level["variants"]["in_process_first_chunk_shared"]
    assert shared["audio_s"] == overlapped["audio_s"]
    assert level["ratios"]["in_process / in_process_first_chunk_shared"]["first_audio_s"] == pytest.approx(
        overlapped["first_audio_s"] / shared["first_audio_s"])


def test_bench_official_is_a_cosyvoice_triton_command(model_dir: Path, capsys) -> None:
    from cosyvoice_triton.cli import main

    assert main(["bench-official", "--model-dir", str(model_dir), "--speech-tokens", "4", "--text-tokens", "2",
                 "--prompt-tokens", "20", "--concurrency", "1", "--repeats", "1", "--json"]) == 0
    [level] = json.loads(capsys.readouterr().out)["levels"]
    assert level["audio_s"] == pytest.approx(4 / 25)


def test_report_from_recorded_official_rounds(model_dir: Path, tmp_path: Path) -> None:
    recorded = json.loads((DATA / "official_rounds_tiny.json").read_text())
    meta = recorded["recorded"]
    side = bench_official.OurSide(str(model_dir), meta["speech_tokens"], meta["text_tokens"], meta["prompt_tokens"])
    rounds = {(1, "our"): [side.round(1)], (1, "official"): recorded["rounds"]["c1_official"]}
    assert rounds[(1, "our")][0]["streams"][0]["audio_s"] == rounds[(1, "official")][0]["streams"][0]["audio_s"]
    result = bench_official.write_report(tmp_path, meta, [1], rounds)
    written = json.loads((tmp_path / "side_by_side.json").read_text())
    assert written["levels"] == json.loads(json.dumps(result["levels"]))
    official, ours = result["levels"][0]["official"], result["levels"][0]["ours"]
    table = (tmp_path / "side_by_side.md").read_text()
    ratio = ours["first_audio_s"] / official["first_audio_s"]
    assert f"| 1 | first audio (median) | {official['first_audio_s']:.2f}s | {ours['first_audio_s']:.2f}s | {ratio:.2f} |" in table
    assert f"exactly {meta['speech_tokens']} speech tokens" in table
