"""perf/stream_profile.py: the timeline of one profiled in-process stream (tiny folder) counts the calls the
stream made, puts first audio's stages before the first chunk, and leaves the pipeline as it found it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.perf import stream_profile
from cosyvoice_triton.random_folder.write import write_random_model

pytestmark = pytest.mark.timeout(600)

N = 110  # speech tokens: a first (48), a middle (50) and a final chunk in the tiny schedule of a 30-token prompt
PROMPT = 30  # 60 prompt frames: one whole 50-frame chunk for the prompt flow cache


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", backbone_weights=False)


@pytest.fixture(scope="module")
def profiled(model_dir: Path):
    """(side, timeline, round result, audio of an unprofiled stream before and after the profiled one)."""
    side = stream_profile.ProfiledSide(str(model_dir), N, 6, PROMPT)
    side.round(1)  # sets the stages up as bench_official does; fills the prompt flow cache
    tts = side.synths[0]
    before = list(tts.synthesize(side.request, stream=True))
    timeline, result = side.profiled_round(1)
    after = list(tts.synthesize(side.request, stream=True))
    return side, timeline, result, before, after


def test_counts_every_llm_step_flow_and_hift_call_of_the_stream(profiled) -> None:
    side, timeline, result, _, _ = profiled
    [stream] = result["streams"]
    chunks = side.chunks[0]
    assert len(chunks) >= 3 and stream["chunks"] == len(chunks)
    whole = stream_profile.whole_stream(timeline, result["streams"])
    # generate() calls step_logits once per token it yields: over the whole prompt first, then one new
    # position per step, so N tokens take the prefill and N - 1 decode steps (batch 1 in this pipeline).
    assert whole["calls"]["prefill"] == 1 and whole["calls"]["decode"] == N - 1 == whole["decode_steps"]
    assert {e.details["batch"] for e in timeline.of(0, "prefill", "decode")} == {1}
    assert whole["calls"]["flow"] == whole["calls"]["hift"] == whole["calls"]["token2wav"] == len(chunks)
    flows = whole["flow_calls"]
    assert sum(c["new_tokens"] for c in flows) == N
    assert [c["full_attention"] for c in flows] == [False] * (len(chunks) - 1) + [True]
    assert sum(c["frames"] for c in flows) == 2 * N  # every token's 2 mel frames emitted once
    assert flows[0]["cached_frames"] == 50  # the voice's whole chunk, seeded from the prompt flow cache
    assert sum(c.size for c in chunks) == sum(e.details["samples"] for e in timeline.of(0, "emit")) == N * 2 * 480
    assert whole["share_of_wall"]["flow"] == pytest.approx(whole["busy_s"]["flow"] / whole["wall_s"])


def test_first_audio_phases_end_before_the_first_chunk(profiled) -> None:
    _, timeline, result, _, _ = profiled
    [stream] = result["streams"]
    first = stream_profile.first_audio(timeline, stream)
    emitted = timeline.of(0, "emit")[0].end
    assert first["first_audio_s"] == pytest.approx(emitted - stream["start"])
    assert (first["flow_calls"], first["hift_calls"], first["prefill_s"] > 0) == (1, 1, True)
    assert 0 < first["decode_steps"] < N - 1
    phases = ["before_prefill_s", "prefill_s", "decode_s", "flow_s", "hift_s", "no_stage_s"]
    assert all(first[name] >= 0 for name in phases)
    # before the first chunk nothing overlaps (the first chunk runs alone): the phases add up to first audio
    assert sum(first[name] for name in phases[1:]) == pytest.approx(first["first_audio_s"])
    [flow] = [e for e in timeline.of(0, "flow") if e.end <= emitted]
    assert timeline.of(0, "prefill")[0].end <= flow.start and flow.end <= timeline.of(0, "hift")[0].start
    assert timeline.of(0, "hift")[0].end <= emitted


def test_the_wrapped_stages_are_restored_and_the_audio_is_the_same(profiled) -> None:
    side, _, _, before, after = profiled
    tts = side.synths[0]
    # the LLM's own step on the instance is perf's exact-length one (bench_official's side), not the timer
    assert vars(tts.llm)["step_logits"].__qualname__ == "exact_length.<locals>.step_logits"
    assert "mel" not in vars(tts.token2wav)
    assert "inference" not in vars(tts.token2wav.hift) and "chunk" not in vars(tts.pipeline.token2wav)
    for audio in (side.chunks[0], after):
        assert len(audio) == len(before)
        assert all(np.array_equal(a, b) for a, b in zip(audio, before))


def test_command_prints_the_tables_and_writes_the_json(model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "profile.json"
    stream_profile.main(["--model-dir", str(model_dir), "--speech-tokens", "30", "--text-tokens", "6",
                         "--prompt-tokens", "20", "--warmup", "0", "--json", str(out)])
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["whole"]["calls"]["decode"] == 29 and report["speech_tokens"] == 30
    assert "| prefill | 1 |" in table and "| decode | 29 |" in table and "load average" in table
    assert [e["stage"] for e in report["timeline"]].count("emit") == report["whole"]["chunks"]
