"""`cosyvoice-triton finetune` on a CosyVoice3 folder (`export --family cosyvoice3 --size tiny`): the folder decides
the family. Data preparation tokenizes with speech_tokenizer_v3.onnx and puts the recipe's instruct before each
transcript; both parts train (full and LoRA) and their losses fall; the written folder is CosyVoice3 again, loads
strictly, leaves out the release's files made from the old weights, and synthesizes with the new weights.
(The losses themselves equal the official CosyVoice3 training code's: test_finetune.py.)"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyvoice_triton.cli import main
from cosyvoice_triton.config import ModelPaths
from cosyvoice_triton.family import COSYVOICE3, END_OF_PROMPT, family_of
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.training.lora import FLOW_TARGETS, LLM_TARGETS
from test_finetune import (SENTENCES, TRAIN_ARGS, finetune, recordings, reuse_features,  # noqa: F401 - recordings: the fixture
                           val_losses)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(900)]

# Files a released folder carries beside its weights, made from them (stand-ins here).
MADE_FROM_LLM, MADE_FROM_FLOW = "llm.rl.pt", "flow.decoder.estimator.fp32.onnx"


@pytest.fixture(scope="module")
def cv3_base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cv3") / "base"
    assert main(["export", "--family", "cosyvoice3", "--size", "tiny", "--out", str(out), "--seed", "3"]) == 0
    shutil.copy(out / "llm.pt", out / MADE_FROM_LLM)
    (out / MADE_FROM_FLOW).write_bytes(b"an export of the base flow")
    return out


@pytest.fixture(scope="module")
def cv3_run(recordings, cv3_base, tmp_path_factory) -> Path:  # noqa: F811 - the imported fixture
    """Both parts, full fine-tuning, 6 steps."""
    out = tmp_path_factory.mktemp("finetuned_cv3") / "both"
    assert finetune("--data", str(recordings), "--model-dir", str(cv3_base), "--out", str(out), "--part", "both",
                    "--max-steps", "6", "--val-every", "2", "--save-every", "6", *TRAIN_ARGS) == 0
    return out


def test_data_preparation_uses_the_v3_tokenizer_and_the_recipes_instruct(cv3_run, cv3_base, recordings):  # noqa: F811
    from cosyvoice_triton.preprocess.audio import decode_audio
    from cosyvoice_triton.preprocess.prompt import PromptEncoder
    from cosyvoice_triton.preprocess.tokenizer import TextTokenizer
    from cosyvoice_triton.training.data_prep import prepare_examples, read_manifest

    assert ModelPaths(cv3_base).speech_tokenizer.name == "speech_tokenizer_v3.onnx"
    assert not (cv3_base / "speech_tokenizer_v2.onnx").exists()
    utterances, _ = read_manifest(recordings)
    examples, _ = prepare_examples(utterances[1:3], cv3_base, cv3_run / "finetune" / "features", progress=False)
    tokenizer = TextTokenizer.from_dir(cv3_base / "CosyVoice-BlankEN", COSYVOICE3.special_tokens)
    encoder = PromptEncoder.from_model_dir(cv3_base, device="cpu")
    for utterance, example in zip(utterances[1:3], examples):
        assert example.instruct_token.tolist() == tokenizer.encode(COSYVOICE3.prompt_prefix)
        assert example.instruct_token[-1] == tokenizer.token_to_id(END_OF_PROMPT)
        assert example.text_token.tolist() == tokenizer.encode(utterance.text)
        samples, rate = decode_audio(utterance.audio_path.read_bytes(), "audio")
        features = encoder.encode(samples, rate, utterance.text)  # the v3 tokens, as at synthesis
        np.testing.assert_array_equal(example.speech_token, features.speech_tokens)
        np.testing.assert_array_equal(example.speech_feat, features.mel)


def test_both_parts_train_and_the_folder_is_cosyvoice3_with_the_new_weights(cv3_run, cv3_base, capsys):
    for part in ("llm", "flow"):
        losses = val_losses(cv3_run, part)
        assert len(losses) == 4  # steps 0, 2, 4, 6
        assert losses[-1] < losses[0], (part, losses)
    assert family_of(cv3_run) is COSYVOICE3
    llm = SpeechLM.from_model_dir(cv3_run)  # strict
    flow = family_models(cv3_run).load_flow(cv3_run)
    for name, model in (("llm.pt", llm), ("flow.pt", flow)):
        base = torch.load(cv3_base / name, weights_only=True)
        assert model.state_dict().keys() == base.keys()
        assert any(not torch.equal(model.state_dict()[k], base[k]) for k in base), f"{name} did not change"
    assert (cv3_run / "hift.pt").read_bytes() == (cv3_base / "hift.pt").read_bytes()
    # the release's files made from the old weights would stand in for the new ones: left out
    assert not (cv3_run / MADE_FROM_LLM).exists() and not (cv3_run / MADE_FROM_FLOW).exists()
    assert (cv3_run / "speech_tokenizer_v3.onnx").exists() and (cv3_run / "cosyvoice3.yaml").exists()


def test_the_fine_tuned_folder_synthesizes(cv3_run, cv3_base, recordings, tmp_path):  # noqa: F811
    from cosyvoice_triton.messages import ConversionRequest
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice
    from cosyvoice_triton.pipeline.voice_conversion import local_converter
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    wav = tmp_path / "synth.wav"
    assert main(["synth", "--model-dir", str(cv3_run), "--prompt-audio", str(recordings / "s01.wav"),
                 "--prompt-text", SENTENCES[1], "--text", "Knowledge is power.", "--seed", "4",
                 "--out", str(wav)]) == 0
    audio, rate = sf.read(wav, dtype="float32")
    assert rate == 24000 and np.isfinite(audio).all()

    def converted(folder: Path) -> np.ndarray:
        """Voice conversion (no LLM: always audio) through the folder's flow and vocoder."""
        tts = CosyVoice.from_model_dir(folder)
        assert tts.family is COSYVOICE3
        samples, rate = sf.read(recordings / "s02.wav", dtype="float32")
        voice = tts.encode_voice(samples, rate, SENTENCES[2])
        request = ConversionRequest(source=speech_like(2.0, 16000, seed=4), sample_rate=16000, voice=voice, seed=2)
        (out,) = list(local_converter(tts).run(request, stream=False))
        return out

    tuned, base = converted(cv3_run), converted(cv3_base)
    assert tuned.size > 0 and np.isfinite(tuned).all()
    assert tuned.shape == base.shape and not np.allclose(tuned, base)  # the new flow makes the mel


def test_lora_on_both_parts_merges_into_the_released_keys(recordings, cv3_base, cv3_run, tmp_path):  # noqa: F811
    out = tmp_path / "lora"
    reuse_features(cv3_run, out)
    assert finetune("--data", str(recordings), "--model-dir", str(cv3_base), "--out", str(out), "--part", "both",
                    "--lora", "--lora-rank", "4", "--max-steps", "6", "--val-every", "3", "--save-every", "6",
                    *TRAIN_ARGS) == 0
    for part, file_name, targets in (("llm", "llm.pt", LLM_TARGETS), ("flow", "flow.pt", FLOW_TARGETS)):
        losses = val_losses(out, part)
        assert losses[-1] < losses[0], (part, losses)
        state = torch.load(out / file_name, weights_only=True)
        base = torch.load(cv3_base / file_name, weights_only=True)
        assert state.keys() == base.keys()  # adapters merged: no lora_A / lora_B / base_layer keys
        changed = {k.rsplit(".", 1)[0] for k in base if not torch.equal(state[k], base[k])}
        assert changed and all(any(m == t or m.endswith("." + t) for t in targets) for m in changed), changed
    assert any(m.endswith("attn.to_q") for m in changed) and any(m.endswith("ff.ff.2") for m in changed)  # DiT
    SpeechLM.from_model_dir(out)
    family_models(out).load_flow(out)
