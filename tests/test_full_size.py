"""A full-size random folder (the released dimensions), written as `cosyvoice-triton export --size full
--no-backbone-weights` writes it, loads as a whole through `CosyVoice2.from_model_dir` and speaks.

Slow (~2.5 GB of fp32 checkpoints written and read back); skip with COSYVOICE_SKIP_FULL=1.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.cli import main as cli_main
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.messages import ChunkPolicy, SynthesisRequest
from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2
from cosyvoice_triton.token2wav.vocoder_stream import VocoderStreamConfig

pytestmark = pytest.mark.skipif(os.environ.get("COSYVOICE_SKIP_FULL") == "1", reason="COSYVOICE_SKIP_FULL=1")

PROMPT_SECONDS = 0.6  # just over the 0.5 s minimum: few prompt frames for the flow
TEXT = "a"
FIRST_HOP = 8  # speech tokens in the first chunk; the LLM makes these plus the flow's 3 lookahead tokens


def millions(module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


@pytest.fixture(scope="module")
def full_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full") / "model"
    # The CLI's own entry point; the 1 GB backbone safetensors is not read by this stack.
    assert cli_main(["export", "--size", "full", "--out", str(out), "--no-backbone-weights"]) == 0
    assert not (out / "CosyVoice-BlankEN" / "model.safetensors").exists()
    return out


@pytest.fixture(scope="module")
def tts(full_model_dir: Path) -> CosyVoice2:
    return CosyVoice2.from_model_dir(full_model_dir)


def test_full_size_folder_loads_strictly(tts: CosyVoice2) -> None:
    llm = tts.llm
    # Qwen2.5-0.5B backbone (494M with the 151936-token vocabulary) plus the speech embedding and head
    assert llm.config.qwen.num_hidden_layers == 24 and llm.config.qwen.hidden_size == 896
    assert 490 < millions(llm) < 520
    assert 100 < millions(tts.token2wav.flow) < 120  # the released flow.pt holds ~112M parameters
    assert 15 < millions(tts.token2wav.hift) < 25  # ~21M


def test_full_size_folder_streams_a_first_chunk(tts: CosyVoice2) -> None:
    """Tokenizer, ONNX stand-ins (voice), LLM, flow and HiFT make the first chunk of a streaming request,
    then the client leaves. A few tokens only: a whole request takes minutes on 2 CPU cores."""
    rate = 16000
    voice = tts.encode_voice(speech_like(PROMPT_SECONDS, rate, seed=0), rate, "hi")
    assert voice.embedding.shape == (192,) and voice.speech_tokens.size > 0
    policy = ChunkPolicy(first_hop=FIRST_HOP, align_to_chunk=False)
    chunks = tts.synthesize(SynthesisRequest(text=TEXT, voice=voice, seed=1, chunk_policy=policy), stream=True)
    audio = next(chunks)
    chunks.close()  # the client leaves: the LLM stream and the vocoder state are dropped
    assert not tts.pipeline.token2wav.streams
    frames = FIRST_HOP * tts.token2wav.token_mel_ratio
    held_back = VocoderStreamConfig().mel_cache_frames  # frames kept for the next chunk's cross-fade
    assert audio.shape == ((frames - held_back) * tts.token2wav.samples_per_frame,)
    assert audio.dtype == np.float32 and np.isfinite(audio).all()
    assert 0 < np.abs(audio).max() <= 0.99 + 1e-6  # HiFT's audio limit
