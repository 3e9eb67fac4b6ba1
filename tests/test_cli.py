"""`cosyvoice-triton export` and `synth`, and model-folder resolution."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_triton.cli import main
from cosyvoice_triton.config import ModelPaths
from cosyvoice_triton.errors import ModelFolderError
from cosyvoice_triton.model_hub import resolve_model_dir


@pytest.fixture(scope="module")
def prompt_path(tmp_path_factory, prompt_wav_16k):
    path = tmp_path_factory.mktemp("prompt") / "prompt.wav"
    sf.write(path, *prompt_wav_16k)
    return path


def test_export_writes_the_released_layout(tmp_path):
    assert main(["export", "--size", "tiny", "--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    paths = ModelPaths(tmp_path / "m")
    assert paths.missing() == []
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "model.safetensors", "generation_config.json"):
        assert (paths.qwen_dir / name).exists()
    assert (tmp_path / "m" / "configuration.json").exists()
    # hift.pt uses the legacy weight-norm names the release most likely has
    import torch
    keys = torch.load(paths.hift, weights_only=True).keys()
    assert any(k.endswith(".weight_g") for k in keys) and any(k.endswith(".weight_v") for k in keys)


def test_export_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("keep me")
    with pytest.raises(FileExistsError):
        main(["export", "--out", str(tmp_path / "x")])


@pytest.mark.parametrize("stream", [False, True])
def test_synth_writes_a_24k_wav(tiny_model_dir, prompt_path, tmp_path, capsys, stream):
    out = tmp_path / "out.wav"
    args = ["synth", "--model-dir", str(tiny_model_dir), "--prompt-wav", str(prompt_path), "--prompt-text", "你好",
            "--text", "欢迎使用。", "--seed", "1", "--out", str(out)]
    assert main(args + (["--stream"] if stream else [])) == 0
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and audio.size > 0 and np.isfinite(audio).all()
    err = capsys.readouterr().err
    assert ("chunk 0:" in err) == stream
    assert "RTF" in err


def test_synth_reports_bad_input_by_field(tiny_model_dir, prompt_path, tmp_path, capsys):
    args = ["synth", "--model-dir", str(tiny_model_dir), "--prompt-wav", str(prompt_path), "--prompt-text", "你好",
            "--text", "   ", "--out", str(tmp_path / "o.wav")]
    assert main(args) == 2
    assert "target_text" in capsys.readouterr().err


def test_model_dir_resolution(tmp_path, monkeypatch):
    assert resolve_model_dir(tmp_path) == tmp_path.resolve()
    with pytest.raises(ModelFolderError, match="does not exist"):
        resolve_model_dir(tmp_path / "missing" / "folder")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: the hub client must fail fast and clearly
    with pytest.raises(ModelFolderError, match="cannot download model 'FunAudioLLM/CosyVoice2-0.5B'"):
        resolve_model_dir("FunAudioLLM/CosyVoice2-0.5B", cache_dir=tmp_path / "cache")


def _fake_modelscope(tmp_path, monkeypatch, body: str) -> None:
    """A `modelscope` package whose snapshot_download runs `body` (no network, no real client)."""
    package = tmp_path / "fake_site" / "modelscope"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("def snapshot_download(model_id, cache_dir=None):\n" + body)
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delitem(sys.modules, "modelscope", raising=False)


def test_a_model_id_downloads_through_modelscope_first(tmp_path, monkeypatch):
    downloaded = tmp_path / "hub" / "CosyVoice2-0.5B"
    body = f"    return {str(downloaded)!r} if model_id == 'FunAudioLLM/CosyVoice2-0.5B' else None\n"
    _fake_modelscope(tmp_path, monkeypatch, body)
    assert resolve_model_dir("FunAudioLLM/CosyVoice2-0.5B") == downloaded


def test_a_failing_modelscope_falls_back_and_both_errors_are_named(tmp_path, monkeypatch):
    _fake_modelscope(tmp_path, monkeypatch, "    raise ConnectionError('modelscope.cn is unreachable')\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelFolderError) as error:
        resolve_model_dir("FunAudioLLM/CosyVoice2-0.5B", cache_dir=tmp_path / "cache")
    message = str(error.value)
    assert "modelscope: ConnectionError: modelscope.cn is unreachable" in message and "huggingface_hub" in message


def test_random_model_weights_are_all_finite_and_moderate(tiny_model_dir):
    """Random folders must be usable for synthesis: no uninitialised memory in any tensor."""
    import torch
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        for key, value in torch.load(tiny_model_dir / name, weights_only=True).items():
            assert torch.isfinite(value).all(), f"{name}:{key}"
            assert value.abs().max() < 1e3, f"{name}:{key}"
