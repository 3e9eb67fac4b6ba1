"""The model family is chosen once from the folder (its yaml); `export --family cosyvoice3` writes a folder in the
released CosyVoice3 layout that loads through the same seam; a folder missing a file, or with a state dict
that does not match its yaml, fails with an error naming the file."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.cli import main
from cosyvoice_triton.config import ModelPaths
from cosyvoice_triton.engines.onnx_session import input_names, open_session
from cosyvoice_triton.errors import InvalidInput, ModelFolderError
from cosyvoice_triton.family import COSYVOICE2, COSYVOICE3, END_OF_PROMPT_ID, family_of
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.models.causal_hift import CausalHiFTGenerator
from cosyvoice_triton.models.dit_flow import DiTFlowModel
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.preprocess.tokenizer import TextTokenizer
from cosyvoice_triton.random_folder.marker import is_random


@pytest.fixture(scope="module")
def cv3_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cv3") / "model"
    assert main(["export", "--family", "cosyvoice3", "--size", "tiny", "--out", str(out), "--seed", "5"]) == 0
    return out


def test_the_yaml_decides_the_family(cv3_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    assert family_of(cv3_dir) is COSYVOICE3 and family_of(tiny_model_dir) is COSYVOICE2
    assert ModelPaths(cv3_dir).speech_tokenizer.name == "speech_tokenizer_v3.onnx"
    assert ModelPaths(tiny_model_dir).speech_tokenizer.name == "speech_tokenizer_v2.onnx"
    with pytest.raises(ModelFolderError, match="cosyvoice2.yaml or cosyvoice3.yaml"):
        family_of(tmp_path)
    assert ModelPaths(tmp_path).missing()[0] == "cosyvoice2.yaml or cosyvoice3.yaml"
    (tmp_path / "cosyvoice2.yaml").write_text("{}")
    (tmp_path / "cosyvoice3.yaml").write_text("{}")
    with pytest.raises(ModelFolderError, match="both"):
        family_of(tmp_path)


def test_each_family_loads_its_own_modules(cv3_dir: Path, tiny_model_dir: Path) -> None:
    for folder, flow, vocoder in ((cv3_dir, DiTFlowModel, CausalHiFTGenerator),
                                  (tiny_model_dir, FlowModel, HiFTGenerator)):
        models = family_models(folder)
        assert isinstance(models.load_flow(folder), flow) and isinstance(models.load_vocoder(folder), vocoder)
        llm = models.load_llm(folder, max_seq_len=16)
        assert llm.config.layout == models.family.lm
        assert (llm.llm_embedding is None) == (models.family is COSYVOICE3)
        assert (llm.llm_decoder.bias is None) == (models.family is COSYVOICE3)


def test_export_writes_the_released_cosyvoice3_layout(cv3_dir: Path) -> None:
    paths = ModelPaths(cv3_dir)
    assert paths.missing() == [] and is_random(cv3_dir)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "model.safetensors", "generation_config.json"):
        assert (paths.qwen_dir / name).exists()
    llm = torch.load(paths.llm, weights_only=True)
    assert "llm_embedding.weight" not in llm and "llm_decoder.bias" not in llm
    assert llm["speech_embedding.weight"].shape[0] == llm["llm_decoder.weight"].shape[0] == 6561 + 200
    assert llm["llm.model.model.embed_tokens.weight"].shape[0] == 151936
    hift = torch.load(paths.hift, weights_only=True)
    assert any(k.endswith(".weight_g") for k in hift) and all(v.dtype == torch.float32 for v in hift.values())
    assert "decoder.estimator.rotary_embed.inv_freq" in torch.load(paths.flow, weights_only=True)


def test_the_tokenizer_stand_in_has_the_released_special_ids(cv3_dir: Path) -> None:
    tokenizer = TextTokenizer.from_dir(cv3_dir / "CosyVoice-BlankEN", COSYVOICE3.special_tokens)
    assert tokenizer.token_to_id("<|endofprompt|>") == END_OF_PROMPT_ID
    assert tokenizer.token_to_id(COSYVOICE3.special_tokens[-1]) == 151923  # the last pronunciation token
    ids = tokenizer.encode(COSYVOICE3.prompt_prefix + "[j][ǐ][AA0]")
    assert END_OF_PROMPT_ID in ids
    assert ids[-3:] == [tokenizer.token_to_id(t) for t in ("[j]", "[ǐ]", "[AA0]")]
    assert max(tokenizer.encode("plain text, 普通话")) < 151643  # the padding entries are never produced


def test_the_speech_tokenizer_stand_in_has_the_v3_contract(cv3_dir: Path) -> None:
    session = open_session(cv3_dir / "speech_tokenizer_v3.onnx", device="cpu")
    assert input_names(session) == ["feats", "feats_length"]
    feats = np.random.default_rng(0).standard_normal((1, 128, 403)).astype(np.float32)
    (tokens,) = session.run(None, {"feats": feats, "feats_length": np.array([403], np.int32)})
    assert tokens.shape == (1, 101) and tokens.dtype == np.int64 and 0 <= tokens.min() and tokens.max() < 6561


def test_a_random_cosyvoice3_folder_speaks(cv3_dir: Path) -> None:
    models = family_models(cv3_dir)
    llm, flow, vocoder = models.load_llm(cv3_dir, max_seq_len=64), models.load_flow(cv3_dir), models.load_vocoder(cv3_dir)
    tokenizer = TextTokenizer.from_dir(cv3_dir / "CosyVoice-BlankEN", COSYVOICE3.special_tokens)
    prompt_text = torch.tensor([tokenizer.encode(COSYVOICE3.prompt_prefix)])
    text = torch.tensor([tokenizer.encode("hello")])
    def best_speech_token(logp: torch.Tensor, decoded, generator) -> int:  # never a stop id: 12 tokens come
        return int(logp[:llm.config.speech_token_size].argmax())

    speech = generate(llm, text, prompt_text, torch.zeros(1, 0, dtype=torch.long), sampler=best_speech_token)
    tokens = [t for _, t in zip(range(12), speech)]
    assert len(tokens) == 12
    n = torch.tensor([len(tokens)])
    mel = flow.inference(torch.tensor([tokens]), n, torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]),
                         torch.zeros(1, 0, 80), torch.tensor([0]), torch.randn(1, 192), streaming=False, finalize=True)
    audio, _ = vocoder.inference(mel)
    assert audio.shape == (1, 2 * len(tokens) * 480) and torch.isfinite(audio).all() and audio.abs().max() > 0


def test_min_len_masks_what_the_official_torch_path_masks(cv3_dir: Path) -> None:
    """CosyVoice3: while fewer than min_len tokens are out, index speech_token_size (SOS) is -inf, and EOS
    (6562), like every other stop id, still ends decoding (the official torch loop; its vLLM path differs)."""
    llm = family_models(cv3_dir).load_llm(cv3_dir, max_seq_len=64)
    config = llm.config
    assert (config.min_len_masked_token, config.eos_token) == (6561, 6562)
    seen = []

    def eos_first(logp: torch.Tensor, decoded, generator) -> int:
        seen.append(logp.clone())
        return config.eos_token

    prompt_text = torch.tensor([[11, END_OF_PROMPT_ID]])
    assert list(generate(llm, torch.tensor([[5, 6, 7]]), prompt_text, torch.zeros(1, 0, dtype=torch.long),
                         sampler=eos_first)) == []
    (logp,) = seen
    assert logp[6561] == -float("inf") and torch.isfinite(logp[6562:]).all()


def test_cosyvoice3_lm_refuses_text_without_end_of_prompt(cv3_dir: Path) -> None:
    llm = family_models(cv3_dir).load_llm(cv3_dir, max_seq_len=64)
    with pytest.raises(InvalidInput, match="prompt_text_token"):
        llm.build_prompt(torch.tensor([[5, 6]]), torch.tensor([[7]]), torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_a_missing_or_mismatched_checkpoint_names_its_file(cv3_dir: Path, tmp_path: Path, name: str) -> None:
    folder = tmp_path / "model"
    shutil.copytree(cv3_dir, folder)
    load = {"llm.pt": lambda: family_models(folder).load_llm(folder, max_seq_len=16),
            "flow.pt": lambda: family_models(folder).load_flow(folder),
            "hift.pt": lambda: family_models(folder).load_vocoder(folder)}[name]
    state = torch.load(folder / name, weights_only=True)
    state.pop(sorted(state)[0])
    torch.save(state, folder / name)
    with pytest.raises(ModelFolderError, match=name):
        load()
    (folder / name).unlink()
    with pytest.raises(ModelFolderError, match=name):
        load()


def test_a_yaml_that_builds_other_classes_is_refused(cv3_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(cv3_dir, folder)
    yaml = folder / "cosyvoice3.yaml"
    yaml.write_text(yaml.read_text().replace("flow.flow.CausalMaskedDiffWithDiT", "flow.flow.CausalMaskedDiffWithXvec")
                    .replace("llm.llm.CosyVoice3LM", "llm.llm.Qwen2LM"))
    with pytest.raises(ModelFolderError, match="cosyvoice3.yaml.*CausalMaskedDiffWithXvec"):
        family_models(folder).load_flow(folder)
    with pytest.raises(ModelFolderError, match="cosyvoice3.yaml.*Qwen2LM"):
        family_models(folder).load_llm(folder, max_seq_len=16)


def test_the_released_extras_are_named_as_not_used_when_the_folder_loads(cv3_dir: Path, tmp_path: Path,
                                                                         caplog) -> None:
    """The released CosyVoice3 folder carries llm.rl.pt and the estimator's ONNX export beside its layout: the
    folder loads, and a log line names each file this stack does not use, with why."""
    import logging

    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice

    folder = tmp_path / "released"
    shutil.copytree(cv3_dir, folder)
    for extra in ("llm.rl.pt", "flow.decoder.estimator.fp32.onnx"):
        (folder / extra).write_bytes(b"not read")
    assert [line.split(":")[0] for line in ModelPaths(folder).unused()] == ["llm.rl.pt",
                                                                            "flow.decoder.estimator.fp32.onnx"]
    assert ModelPaths(cv3_dir).unused() == []
    with caplog.at_level(logging.WARNING):
        CosyVoice.from_model_dir(folder)
    logged = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(logged) == 2 and "llm.pt" in logged[0] and "flow.pt" in logged[1]
