"""Fine-tuning: losses equal the official training code's, and `cosyvoice-triton finetune` turns a folder
of recordings into a model folder that the service loads strictly and serves."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.config import read_yaml
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.training.losses import (FlowBatch, FlowLossConfig, LMBatch, draw_flow_noise, flow_loss,
                                              lm_loss)

DATA_DIR = Path(__file__).resolve().parent / "data"
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def official() -> dict[str, np.ndarray]:
    with np.load(DATA_DIR / "official_losses.npz") as data:
        return {key: data[key] for key in data.files}


def test_llm_loss_equals_the_official_loss(golden_model_dir, official):
    model = SpeechLM.from_model_dir(golden_model_dir, max_seq_len=256)
    batch = LMBatch(*(torch.from_numpy(official[f"lm_{key}"]).long() for key in
                      ("text_token", "text_token_len", "speech_token", "speech_token_len")))
    with torch.no_grad():
        out = lm_loss(model, batch)
    assert abs(out.loss.item() - float(official["lm_loss"])) < LOSS_TOLERANCE
    assert abs(out.accuracy.item() - float(official["lm_accuracy"])) < LOSS_TOLERANCE


@pytest.mark.parametrize("case", [0, 1])
def test_flow_loss_equals_the_official_loss(golden_model_dir, official, case):
    model = FlowModel.from_model_dir(golden_model_dir)
    config = FlowLossConfig.from_yaml(read_yaml(golden_model_dir / "cosyvoice2.yaml"))
    assert (config.sigma_min, config.training_cfg_rate) == (official["flow_sigma_min"],
                                                            official["flow_training_cfg_rate"])
    batch = FlowBatch(torch.from_numpy(official["flow_speech_token"]).long(),
                      torch.from_numpy(official["flow_speech_token_len"]).long(),
                      torch.from_numpy(official["flow_speech_feat"]), torch.from_numpy(official["flow_embedding"]))
    # Our draws from a generator seeded as the official run's global RNG are the official draws.
    generator = torch.Generator().manual_seed(int(official[f"flow{case}_seed"]))
    noise = draw_flow_noise(batch.speech_token.size(0), batch.speech_feat.size(2), batch.speech_feat.size(1),
                            config.training_cfg_rate, generator)
    assert torch.equal(noise.t, torch.from_numpy(official[f"flow{case}_t"]))
    assert torch.equal(noise.z, torch.from_numpy(official[f"flow{case}_z"]))
    assert noise.keep_condition.tolist() == official[f"flow{case}_keep_condition"].tolist()
    with torch.no_grad():
        out = flow_loss(model, batch, noise, torch.from_numpy(official[f"flow{case}_prompt_frames"]),
                        bool(official[f"flow{case}_streaming"]), config.sigma_min, config.training_cfg_rate)
    assert abs(out.loss.item() - float(official[f"flow{case}_loss"])) < LOSS_TOLERANCE
