"""The ONNX session helper, our own ONNX stand-ins, and the prompt encoder.

The golden folder's stand-ins against their recorded outputs: test_golden.py."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest

from cosyvoice_triton.engines.onnx_session import open_session, providers_for
from cosyvoice_triton.errors import InvalidInput, ModelFolderError
from cosyvoice_triton.random_folder.onnx_standins import write_campplus_standin, write_speech_tokenizer_standin
from cosyvoice_triton.preprocess.features import speaker_fbank, whisper_log_mel
from cosyvoice_triton.preprocess.prompt import PromptEncoder
from cosyvoice_triton.preprocess.voice_features import audio_sha256

SPEECH_CODEBOOK = 6561


def voice(f0: float, formant: float, seconds: float = 2.0, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A crude vowel: harmonics of `f0` shaped by one formant, peak 0.3."""
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.04 * np.sin(2 * np.pi * 5 * t))) / rate
    wave = sum(np.sin(k * phase) * np.exp(-((k * f0 - formant) / 600.0) ** 2) for k in range(1, 40)
               if k * f0 < rate / 2)
    wave = wave * (1.2 + np.sin(2 * np.pi * 3 * t)) + 0.005 * np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * wave / np.abs(wave).max()).astype(np.float32)


def dims(value_info: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def standins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("standins")
    paths = {"campplus": folder / "campplus.onnx", "tokenizer": folder / "speech_tokenizer_v2.onnx"}
    write_campplus_standin(paths["campplus"], seed=7)
    write_speech_tokenizer_standin(paths["tokenizer"], seed=7)
    return paths


# --- session helper ---

def test_cpu_provider_always_available() -> None:
    assert providers_for("cpu") == ["CPUExecutionProvider"]
    assert providers_for("auto")[-1] == "CPUExecutionProvider"


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError):
        open_session(tmp_path / "nothing.onnx")


# --- our stand-ins ---

def test_campplus_contract(standins: dict[str, Path]) -> None:
    model = onnx.load(str(standins["campplus"]))
    (graph_input,), (graph_output,) = model.graph.input, model.graph.output
    assert (graph_input.name, graph_input.type.tensor_type.elem_type) == ("input", onnx.TensorProto.FLOAT)
    assert (graph_output.name, graph_output.type.tensor_type.elem_type) == ("output", onnx.TensorProto.FLOAT)
    assert dims(graph_input) == ["B", "T", 80] and dims(graph_output) == ["B", 192]
    session = open_session(standins["campplus"], device="cpu")
    for batch, frames in [(1, 50), (3, 7), (2, 300)]:
        feats = np.random.default_rng(frames).standard_normal((batch, frames, 80)).astype(np.float32)
        out = session.run(None, {"input": feats})[0]
        assert out.shape == (batch, 192) and out.dtype == np.float32 and np.all(np.isfinite(out))
        np.testing.assert_allclose(out[:1], session.run(None, {"input": feats[:1]})[0], atol=1e-5)


def test_speech_tokenizer_contract(standins: dict[str, Path]) -> None:
    model = onnx.load(str(standins["tokenizer"]))
    inputs = {i.name: i for i in model.graph.input}
    (graph_output,) = model.graph.output
    assert [i.name for i in model.graph.input] == ["feats", "feats_length"]
    assert inputs["feats"].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert inputs["feats_length"].type.tensor_type.elem_type == onnx.TensorProto.INT32
    assert graph_output.name == "indices" and graph_output.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert dims(inputs["feats"]) == ["B", 128, "T"] and dims(inputs["feats_length"]) == ["B"]
    assert dims(graph_output) == ["B", "T2"]
    session = open_session(standins["tokenizer"], device="cpu")
    rng = np.random.default_rng(0)
    for batch, frames in [(1, 403), (2, 400), (1, 1), (3, 97)]:
        feats = (rng.standard_normal((batch, 128, frames)) * 0.5).astype(np.float32)
        lengths = np.full((batch,), frames, np.int32)
        out = session.run(None, {"feats": feats, "feats_length": lengths})[0]
        assert out.shape == (batch, math.ceil(frames / 4)) and out.dtype == np.int64
        assert out.min() >= 0 and out.max() < SPEECH_CODEBOOK


def test_speech_tokenizer_batch_matches_single(standins: dict[str, Path]) -> None:
    session = open_session(standins["tokenizer"], device="cpu")
    first = whisper_log_mel(voice(120.0, 700.0)).numpy()
    second = whisper_log_mel(voice(220.0, 1800.0)).numpy()
    batch = np.stack([first, second])
    out = session.run(None, {"feats": batch, "feats_length": np.array([200, 200], np.int32)})[0]
    for row, feats in zip(out, [first, second], strict=True):
        single = session.run(None, {"feats": feats[None], "feats_length": np.array([200], np.int32)})[0][0]
        np.testing.assert_array_equal(row, single)


def test_speech_tokenizer_ignores_frames_past_the_length(standins: dict[str, Path]) -> None:
    session = open_session(standins["tokenizer"], device="cpu")
    feats = whisper_log_mel(voice(150.0, 1000.0)).numpy()[None]
    noisy = feats.copy()
    noisy[:, :, 120:] = np.random.default_rng(1).standard_normal(noisy[:, :, 120:].shape)
    length = np.array([120], np.int32)
    np.testing.assert_array_equal(session.run(None, {"feats": feats, "feats_length": length})[0],
                                  session.run(None, {"feats": noisy, "feats_length": length})[0])


def test_standins_are_deterministic(tmp_path: Path, standins: dict[str, Path]) -> None:
    write_campplus_standin(tmp_path / "a.onnx", seed=7)
    write_speech_tokenizer_standin(tmp_path / "b.onnx", seed=7)
    write_campplus_standin(tmp_path / "c.onnx", seed=8)
    assert (tmp_path / "a.onnx").read_bytes() == standins["campplus"].read_bytes()
    assert (tmp_path / "b.onnx").read_bytes() == standins["tokenizer"].read_bytes()
    assert (tmp_path / "c.onnx").read_bytes() != standins["campplus"].read_bytes()


def test_standins_tell_voices_apart(standins: dict[str, Path]) -> None:
    campplus = open_session(standins["campplus"], device="cpu")
    tokenizer = open_session(standins["tokenizer"], device="cpu")
    voices = {"low": voice(110.0, 700.0), "low_quiet": 0.1 * voice(110.0, 700.0, seed=1),
              "high": voice(230.0, 2200.0)}
    embeddings = {key: campplus.run(None, {"input": speaker_fbank(wav).numpy()[None]})[0][0]
                  for key, wav in voices.items()}
    same_voice = cosine(embeddings["low"], embeddings["low_quiet"])  # other level and noise
    assert same_voice > 0.95
    assert cosine(embeddings["low"], embeddings["high"]) < same_voice - 0.2
    tokens = {}
    for key, wav in voices.items():
        feats = whisper_log_mel(wav).numpy()[None]
        lengths = np.array([feats.shape[2]], np.int32)
        tokens[key] = tokenizer.run(None, {"feats": feats, "feats_length": lengths})[0]
    assert np.mean(tokens["low"] != tokens["high"]) > 0.5
    assert len(np.unique(tokens["high"])) > 5


# --- prompt encoder on the golden model folder ---

@pytest.fixture(scope="module")
def encoder(golden_model_dir: Path) -> PromptEncoder:
    return PromptEncoder.from_model_dir(golden_model_dir, device="cpu")


@pytest.mark.parametrize("rate, seconds", [(16000, 3.0), (24000, 2.37), (44100, 1.01), (8000, 0.6)])
def test_prompt_encoder_aligns_tokens_and_mel(encoder: PromptEncoder, rate: int, seconds: float) -> None:
    samples = voice(140.0, 900.0, seconds=seconds, rate=rate)
    features = encoder.encode(samples, rate, "希望你以后能够做的比我还好呦。")
    n_tokens = features.speech_tokens.shape[0]
    assert features.embedding.shape == (192,) and features.embedding.dtype == np.float32
    assert features.speech_tokens.dtype == np.int32 and n_tokens > 0
    assert features.speech_tokens.min() >= 0 and features.speech_tokens.max() < SPEECH_CODEBOOK
    assert features.mel.shape == (2 * n_tokens, 80) and features.mel.dtype == np.float32
    assert abs(n_tokens - round(seconds * 25)) <= 1
    assert features.text == "希望你以后能够做的比我还好呦。"
    assert features.audio_sha256 == audio_sha256(samples, rate)


def test_prompt_encoder_is_deterministic_and_voice_dependent(encoder: PromptEncoder) -> None:
    first = encoder.encode(voice(120.0, 700.0), 16000, "a")
    again = encoder.encode(voice(120.0, 700.0), 16000, "a")
    other = encoder.encode(voice(240.0, 2000.0), 16000, "a")
    np.testing.assert_array_equal(first.speech_tokens, again.speech_tokens)
    np.testing.assert_array_equal(first.embedding, again.embedding)
    assert first.audio_sha256 == again.audio_sha256 != other.audio_sha256
    assert not np.allclose(first.embedding, other.embedding)


def test_prompt_encoder_rejects_bad_audio(encoder: PromptEncoder) -> None:
    with pytest.raises(InvalidInput, match="at most 30 s") as error:
        encoder.encode(voice(120.0, 700.0, seconds=31.0), 16000, "a", field="prompt_wav")
    assert error.value.field == "prompt_wav"
    with pytest.raises(InvalidInput, match="silent"):
        encoder.encode(np.zeros(16000, np.float32), 16000, "a")
