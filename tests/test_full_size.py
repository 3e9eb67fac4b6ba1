"""A full-size random folder (the released dimensions) is written by `export/` and loads strictly."""
from __future__ import annotations

import os

import pytest

from cosyvoice_triton.export.random_model import write_random_model
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.speech_lm import SpeechLM

pytestmark = pytest.mark.skipif(os.environ.get("COSYVOICE_SKIP_FULL") == "1", reason="COSYVOICE_SKIP_FULL=1")


def millions(module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


def test_full_size_folder_loads_strictly(tmp_path):
    model_dir = write_random_model(tmp_path / "full", size="full", backbone_weights=False)
    llm = SpeechLM.from_model_dir(model_dir, max_seq_len=16)
    # Qwen2.5-0.5B backbone (494M with the 151936-token vocabulary) plus the speech embedding and head
    assert llm.config.qwen.num_hidden_layers == 24 and llm.config.qwen.hidden_size == 896
    assert 490 < millions(llm) < 520
    del llm
    flow = FlowModel.from_model_dir(model_dir)
    assert 100 < millions(flow) < 120  # the released flow.pt holds ~112M parameters
    del flow
    hift = HiFTGenerator.from_model_dir(model_dir)
    assert 15 < millions(hift) < 25  # ~21M
