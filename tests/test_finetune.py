"""Fine-tuning: losses equal the official training code's (both families), and `cosyvoice-triton finetune` turns
a folder of recordings into a model folder that the service loads strictly and serves (CosyVoice3's run:
test_finetune_cv3.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.config import ModelPaths, read_yaml
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.training.losses import (FlowBatch, FlowLossConfig, LMBatch, draw_flow_noise, flow_loss,
                                              lm_loss)

DATA_DIR = Path(__file__).resolve().parent / "data"
CV3_GOLDEN_MODEL = Path(__file__).resolve().parent / "golden" / "cv3" / "tiny" / "model"
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def official(request, golden_model_dir) -> tuple[Path, dict[str, np.ndarray]]:
    """(tiny golden folder, the official losses on it): tests/data/README.md says how they were made."""
    model_dir, name = ((golden_model_dir, "official_losses.npz") if request.param == "cosyvoice2"
                       else (CV3_GOLDEN_MODEL, "official_losses_cv3.npz"))
    with np.load(DATA_DIR / name) as data:
        return model_dir, {key: data[key] for key in data.files}


def official_lm_batch(arrays: dict[str, np.ndarray], prefix: str) -> LMBatch:
    """The stored LM batch `prefix` ("lm", "lmb"), with CosyVoice3's instruct where it has one."""
    keys = ("text_token", "text_token_len", "speech_token", "speech_token_len", "instruct_token", "instruct_token_len")
    return LMBatch(*(torch.from_numpy(arrays[f"{prefix}_{key}"]).long() if f"{prefix}_{key}" in arrays else None
                     for key in keys))


def test_llm_loss_equals_the_official_loss(official):
    model_dir, arrays = official
    model = SpeechLM.from_model_dir(model_dir, max_seq_len=256)
    with torch.no_grad():
        out = lm_loss(model, official_lm_batch(arrays, "lm"))
    assert abs(out.loss.item() - float(arrays["lm_loss"])) < LOSS_TOLERANCE
    assert abs(out.accuracy.item() - float(arrays["lm_accuracy"])) < LOSS_TOLERANCE


def test_llm_loss_of_bistream_rows_equals_the_official_loss(official):
    """Rows drawn for the bistream layout interleave 5 text and 15 speech tokens (a row whose speech is not more
    than 3x its text stays unistream), as the official forward lays them out."""
    model_dir, arrays = official
    model = SpeechLM.from_model_dir(model_dir, max_seq_len=256)
    batch, draws = official_lm_batch(arrays, "lmb"), torch.from_numpy(arrays["lmb_draws"])
    with torch.no_grad():
        bistream = lm_loss(model, batch, bistream=draws)
        unistream = lm_loss(model, batch)
    assert abs(bistream.loss.item() - float(arrays["lmb_loss"])) < LOSS_TOLERANCE
    assert abs(bistream.accuracy.item() - float(arrays["lmb_accuracy"])) < LOSS_TOLERANCE
    assert abs(unistream.loss.item() - float(arrays["lmb_loss"])) > 100 * LOSS_TOLERANCE  # the layout counts


@pytest.mark.parametrize("case", [0, 1])
def test_flow_loss_equals_the_official_loss(official, case):
    model_dir, arrays = official
    model = family_models(model_dir).load_flow(model_dir)  # CosyVoice2's FlowModel or CosyVoice3's DiT flow
    config = FlowLossConfig.from_yaml(read_yaml(ModelPaths(model_dir).yaml))
    assert (config.sigma_min, config.training_cfg_rate) == (arrays["flow_sigma_min"],
                                                            arrays["flow_training_cfg_rate"])
    batch = FlowBatch(torch.from_numpy(arrays["flow_speech_token"]).long(),
                      torch.from_numpy(arrays["flow_speech_token_len"]).long(),
                      torch.from_numpy(arrays["flow_speech_feat"]), torch.from_numpy(arrays["flow_embedding"]))
    # Our draws from a generator seeded as the official run's global RNG are the official draws.
    generator = torch.Generator().manual_seed(int(arrays[f"flow{case}_seed"]))
    noise = draw_flow_noise(batch.speech_token.size(0), batch.speech_feat.size(2), batch.speech_feat.size(1),
                            config.training_cfg_rate, generator)
    assert torch.equal(noise.t, torch.from_numpy(arrays[f"flow{case}_t"]))
    assert torch.equal(noise.z, torch.from_numpy(arrays[f"flow{case}_z"]))
    assert noise.keep_condition.tolist() == arrays[f"flow{case}_keep_condition"].tolist()
    with torch.no_grad():
        out = flow_loss(model, batch, noise, torch.from_numpy(arrays[f"flow{case}_prompt_frames"]),
                        bool(arrays[f"flow{case}_streaming"]), config.sigma_min, config.training_cfg_rate)
    assert abs(out.loss.item() - float(arrays[f"flow{case}_loss"])) < LOSS_TOLERANCE


# --- pieces of the run -------------------------------------------------------------------------------


def test_kaldi_layout_is_read_and_an_utterance_without_transcript_is_reported(tmp_path):
    from cosyvoice_triton.training.data_prep import read_manifest

    (tmp_path / "wav.scp").write_text("utt1 clips/a.wav\nutt2 /abs/b.flac\nutt3 clips/c.wav\n")
    (tmp_path / "text").write_text("utt1 First sentence.\nutt2 Second one.\n")
    utterances, skipped = read_manifest(tmp_path)
    assert [(u.name, u.audio_path, u.text) for u in utterances] == [
        ("utt1", tmp_path / "clips" / "a.wav", "First sentence."), ("utt2", Path("/abs/b.flac"), "Second one.")]
    assert [(s.name, s.reason) for s in skipped] == [("utt3", "no transcript in text")]


def test_batches_respect_both_limits_and_ranks_share_them_out():
    from cosyvoice_triton.training.dataset import epoch_batches

    lengths = [10, 50, 20, 40, 30, 60, 10, 25, 35, 45]
    batches = epoch_batches(lengths, epoch=0, seed=1, batch_size=3, max_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(10))  # every example once per epoch
    assert all(len(b) <= 3 and len(b) * max(lengths[i] for i in b) <= 100 or len(b) == 1 for b in batches)
    assert epoch_batches(lengths, 1, 1, 3, 100) != batches  # reshuffled each epoch
    assert epoch_batches(lengths, 0, 1, 3, 100) == batches  # ... the same way on every rank and rerun
    rank0, rank1 = (epoch_batches(lengths, 0, 1, 3, 100, rank=r, world_size=2) for r in (0, 1))
    assert len(rank0) == len(rank1) == len(batches) // 2
    assert not {i for b in rank0 for i in b} & {i for b in rank1 for i in b}


def test_files_made_from_replaced_weights_are_left_out(tmp_path):
    """The release's exports of a weight file (its ONNX, TorchScript or TensorRT files, CosyVoice3's llm.rl.pt)
    would stand in for new weights: they are not copied beside them; everything else is."""
    from cosyvoice_triton.training.model_folder import copy_base_files

    base = tmp_path / "base"
    (base / "onnx").mkdir(parents=True)
    (base / "finetune").mkdir()
    names = ("llm.pt", "llm.rl.pt", "flow.pt", "flow.decoder.estimator.fp32.onnx", "flow.cache.pt", "hift.pt",
             "spk2info.pt", "cosyvoice3.yaml")
    for name in names:
        (base / name).write_text(name)
    assert copy_base_files(base, tmp_path / "llm_only", {"llm.pt"}) == ["llm.rl.pt", "onnx"]
    assert sorted(p.name for p in (tmp_path / "llm_only").iterdir()) == sorted(
        {"flow.pt", "flow.decoder.estimator.fp32.onnx", "flow.cache.pt", "hift.pt", "spk2info.pt", "cosyvoice3.yaml"})
    assert copy_base_files(base, tmp_path / "both", {"llm.pt", "flow.pt"}) == [
        "flow.cache.pt", "flow.decoder.estimator.fp32.onnx", "llm.rl.pt", "onnx"]
    assert sorted(p.name for p in (tmp_path / "both").iterdir()) == ["cosyvoice3.yaml", "hift.pt", "spk2info.pt"]


def test_warmup_schedule_is_the_recipes_warmuplr():
    from cosyvoice_triton.training.trainer import lr_factor

    assert lr_factor(0, 0) == lr_factor(5000, 0) == 1.0  # constant: the recipe's fine-tuning setting
    warmup = 100
    assert lr_factor(warmup - 1, warmup) == pytest.approx(1.0)  # peak at step `warmup`
    assert lr_factor(9, warmup) == pytest.approx(10 / warmup)  # linear rise
    assert lr_factor(4 * warmup - 1, warmup) == pytest.approx(0.5)  # then 1/sqrt decay


# --- fine-tuning end to end on a tiny synthetic data set ---------------------------------------------

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine.",
    "She sells sea shells by the sea shore.", "The rain in Spain stays mainly in the plain.",
    "Every good boy deserves fruit.", "How much wood would a woodchuck chuck?",
    "Peter Piper picked a peck of pickled peppers.", "All that glitters is not gold.",
    "The early bird catches the worm.", "Actions speak louder than words.",
    "Better late than never.", "Birds of a feather flock together.",
    "Fortune favours the bold.", "Knowledge is power.", "Practice makes perfect.",
    "Time flies like an arrow.", "Where there is a will, there is a way.",
    "Honesty is the best policy.", "Look before you leap.", "Two heads are better than one.",
]
TRAIN_ARGS = ["--batch-size", "4", "--grad-accum", "1", "--lr", "1e-3", "--val-share", "0.15", "--no-progress",
              "--device", "cpu"]


def metrics(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "finetune" / "metrics.jsonl").read_text().splitlines()]


def val_losses(out: Path, part: str) -> list[float]:
    return [r[f"val/{part}_loss"] for r in metrics(out) if f"val/{part}_loss" in r]


def train_losses(out: Path, part: str) -> dict[int, float]:
    return {r["step"]: r[f"train/{part}_loss"] for r in metrics(out) if f"train/{part}_loss" in r}


@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> Path:
    """20 espeak-ng sentences (22.05 kHz wav; the feature code resamples) in metadata.csv, plus three bad
    entries: an undecodable file, a missing file and an empty transcript."""
    import shutil
    import subprocess

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/setup.sh installs it)")
    data = tmp_path_factory.mktemp("recordings")
    lines = []
    for i, sentence in enumerate(SENTENCES):
        subprocess.run(["espeak-ng", "-w", str(data / f"s{i:02d}.wav"), sentence], check=True)
        lines.append(f"s{i:02d}.wav|{sentence}")
    (data / "broken.wav").write_bytes(b"RIFF not really a wave file")
    lines += ["broken.wav|This file is broken.", "missing.wav|This file does not exist.", "s00.wav|"]
    (data / "metadata.csv").write_text("\n".join(lines) + "\n")
    return data


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir) -> Path:
    return tiny_model_dir


def finetune(*args: str) -> int:
    from cosyvoice_triton.cli import main

    return main(["finetune", *args])


def reuse_features(source: Path, out: Path) -> None:
    """Copy a run's feature cache into a new output folder (the cache is keyed by content, not by run)."""
    import shutil

    shutil.copytree(source / "finetune" / "features", out / "finetune" / "features")


@pytest.fixture(scope="module")
def resumed_run(recordings, base_dir, tmp_path_factory) -> Path:
    """Both parts, full fine-tuning: 4 steps, then resumed to 8."""
    out = tmp_path_factory.mktemp("finetuned") / "both"
    common = ["--data", str(recordings), "--model-dir", str(base_dir), "--out", str(out), "--part", "both",
              "--val-every", "2", "--save-every", "2", *TRAIN_ARGS]
    assert finetune(*common, "--max-steps", "4") == 0
    assert finetune(*common, "--max-steps", "8", "--resume") == 0
    return out


def test_bad_recordings_are_reported_by_name_and_reason_and_skipped(resumed_run, capsys):
    skipped = dict(line.split("\t") for line in (resumed_run / "finetune" / "skipped.tsv").read_text().splitlines())
    assert skipped.keys() == {"broken.wav", "missing.wav", "s00.wav"}
    assert "decoded" in skipped["broken.wav"]
    assert "not found" in skipped["missing.wav"]
    assert skipped["s00.wav"] == "empty transcript"
    features = list((resumed_run / "finetune" / "features").glob("*.npz"))
    assert len(features) == len(SENTENCES)  # one cache entry per usable recording, none for the bad ones


def test_validation_loss_falls_and_the_folder_loads_strictly(resumed_run, base_dir):
    for part in ("llm", "flow"):
        losses = val_losses(resumed_run, part)
        assert len(losses) == 5  # steps 0, 2, 4 (first run), 6, 8 (resumed)
        assert losses[-1] < losses[0], (part, losses)
    llm = SpeechLM.from_model_dir(resumed_run)  # strict
    flow = FlowModel.from_model_dir(resumed_run)
    for name, model in (("llm.pt", llm), ("flow.pt", flow)):
        base = torch.load(base_dir / name, weights_only=True)
        assert model.state_dict().keys() == base.keys()
        assert any(not torch.equal(model.state_dict()[k], base[k]) for k in base), f"{name} did not change"
    assert (resumed_run / "hift.pt").read_bytes() == (base_dir / "hift.pt").read_bytes()


def test_resume_continues_the_step_counter_and_the_loss_curve(resumed_run, recordings, base_dir, tmp_path):
    steps = [r["step"] for r in metrics(resumed_run)]
    assert steps == list(range(0, 9)), steps  # no step twice, none missing: resumed at 5, not at 1
    # The same 8 steps without an interruption give the same losses: optimizer, schedule, data order
    # and random draws all continued from the checkpoint.
    straight = tmp_path / "straight"
    reuse_features(resumed_run, straight)
    assert finetune("--data", str(recordings), "--model-dir", str(base_dir), "--out", str(straight), "--part",
                    "both", "--val-every", "2", "--save-every", "8", "--max-steps", "8", *TRAIN_ARGS) == 0
    for part in ("llm", "flow"):
        resumed, uninterrupted = train_losses(resumed_run, part), train_losses(straight, part)
        assert resumed.keys() == uninterrupted.keys() == set(range(1, 9))
        np.testing.assert_allclose([resumed[s] for s in range(5, 9)], [uninterrupted[s] for s in range(5, 9)],
                                   rtol=1e-5)


def test_lora_run_merges_into_the_released_keys(recordings, base_dir, resumed_run, tmp_path):
    out = tmp_path / "lora"
    reuse_features(resumed_run, out)
    assert finetune("--data", str(recordings), "--model-dir", str(base_dir), "--out", str(out), "--part", "llm",
                    "--lora", "--lora-rank", "8", "--max-steps", "12", "--val-every", "6", "--save-every", "6",
                    "--average", "2", *TRAIN_ARGS) == 0
    losses = val_losses(out, "llm")
    assert losses[-1] < losses[0], losses
    state = torch.load(out / "llm.pt", weights_only=True)
    base = torch.load(base_dir / "llm.pt", weights_only=True)
    assert state.keys() == base.keys()  # adapters merged: no lora_A / lora_B / base_layer keys
    changed = {k for k in base if not torch.equal(state[k], base[k])}
    assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj") for k in changed), changed
    assert (out / "flow.pt").read_bytes() == (base_dir / "flow.pt").read_bytes()  # --part llm: flow copied
    SpeechLM.from_model_dir(out)


def test_a_second_run_into_the_same_folder_needs_resume(recordings, base_dir, resumed_run, capsys):
    assert finetune("--data", str(recordings), "--model-dir", str(base_dir), "--out", str(resumed_run),
                    "--part", "both", "--max-steps", "20", *TRAIN_ARGS) == 2
    assert "--resume" in capsys.readouterr().err


def test_the_service_serves_the_fine_tuned_folder(resumed_run, recordings, tmp_path):
    from cosyvoice_triton.client import TritonTTS
    from web.stack import triton_server

    with triton_server(tmp_path, model_dir=resumed_run, shared=False) as (server, _, _):
        configs = "".join(p.read_text() for p in (tmp_path / "run" / "repo").glob("*/config.pbtxt"))
        assert str(resumed_run) in configs
        with TritonTTS(server.grpc_url) as tts:
            audio = tts.synthesize("Knowledge is power.", prompt_audio=str(recordings / "s01.wav"),
                                   prompt_text=SENTENCES[1], seed=1, offline=True)
    assert audio.size > 0 and np.isfinite(audio).all()


def test_torchrun_trains_with_two_processes(recordings, base_dir, resumed_run, tmp_path):
    """DistributedDataParallel over gloo on the CPU: the README's torchrun command with 2 processes."""
    import subprocess
    import sys

    out = tmp_path / "ddp"
    reuse_features(resumed_run, out)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "cosyvoice_triton.training", "--data", str(recordings), "--model-dir", str(base_dir),
               "--out", str(out), "--max-steps", "4", "--val-every", "2", "--save-every", "4", *TRAIN_ARGS]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size 2" in result.stderr
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3, 4]
    losses = val_losses(out, "llm")
    assert losses[-1] < losses[0], losses
    SpeechLM.from_model_dir(out)  # strict
