"""test_golden_cv3.py passes unchanged on a set of other dimensions, lengths, seeds and thread count than the
official one: it takes them from the checkpoint, the arrays and golden.json, as the golden README asks.

The set is made by this project's own modules (tests/golden_cv3_maker.py) on a random folder that
`write_random_model` writes with other dimensions, so it checks the test, not fidelity (the official set does).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.random_folder.cosyvoice3_yaml import COSYVOICE3_SIZES, CosyVoice3Size
from golden_cv3_maker import make_golden_set

REPO_ROOT = Path(__file__).resolve().parents[1]
OFFICIAL_SET = REPO_ROOT / "tests" / "golden" / "cv3" / "tiny"

# Every dimension the yaml and the Qwen config take differs from the official tiny set's.
OTHER_SIZE = CosyVoice3Size(llm_size=48, qwen_layers=1, qwen_heads=6, qwen_kv_heads=3, qwen_intermediate=96,
                            lookahead_channels=40, dit_dim=48, dit_depth=1, dit_heads=3, dit_head_dim=8,
                            hift_channels=16)


@pytest.fixture(scope="module")
def other_set(tmp_path_factory) -> Path:
    assert all(getattr(OTHER_SIZE, name) != getattr(COSYVOICE3_SIZES["tiny"], name)
               for name in OTHER_SIZE.__dataclass_fields__)
    return make_golden_set(tmp_path_factory.mktemp("golden_cv3") / "other", OTHER_SIZE, model_seed=11,
                           seed_inputs=4242, hift_seed=77, threads=2)


def test_the_other_set_differs_in_lengths_and_streams_in_chunks(other_set: Path) -> None:
    with np.load(OFFICIAL_SET / "golden.npz") as official, np.load(other_set / "golden.npz") as other:
        assert set(official.files) - {"e2e_stream_chunk2", "hift_stream_chunk2"} <= set(other.files)
        for key in ("in_text_token", "in_prompt_speech_token", "flow_token", "llm_lm_input", "hift_speech"):
            assert official[key].shape != other[key].shape, key
        assert len(other["flow_stream_chunk_token_ends"]) >= 2  # at least two streaming chunks and the final one


def test_the_golden_test_passes_unchanged_on_the_other_set(other_set: Path) -> None:
    env = {**os.environ, "COSYVOICE_GOLDEN_CV3_DIR": str(other_set), "COSYVOICE_STRICT_TESTS": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/test_golden_cv3.py", "-q", "-p", "no:cacheprovider"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, summary
