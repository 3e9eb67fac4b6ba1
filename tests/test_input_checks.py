"""Library input checks that every boundary relies on: request text, prompt recordings, id echoes."""
from __future__ import annotations

import dataclasses
import io
import re

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.preprocess.audio import load_prompt_audio, spectral_flatness
from cosyvoice_triton.wire.checks import validate_text
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.voices.store import check_voice_id, short_repr


@pytest.mark.parametrize("text, problem", [
    ("\u001b[31mred", "control character U+001B at position 0"),
    ("a\u0000b", "control character U+0000 at position 1"),
    ("a\ud800b.", "lone surrogate U+D800 at position 1"),
    ("x\u0085", "control character U+0085"),
])
def test_text_with_control_characters_or_surrogates_is_refused(text, problem):
    with pytest.raises(InvalidInput, match=re.escape(problem)) as caught:
        validate_text(text, "text")
    assert caught.value.field == "text"


def test_tabs_newlines_and_joiners_are_text():
    text = "Line one.\r\n\tLine two, a\u200dzero-width joiner."
    assert validate_text(text, "text") == text


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def test_a_wav_header_followed_by_garbage_is_refused():
    header = wav(np.zeros(16000, np.float32))[:44]
    garbage = header + np.random.default_rng(0).bytes(64000)
    with pytest.raises(InvalidInput, match="white noise") as caught:
        load_prompt_audio(garbage, "prompt_audio")
    assert caught.value.field == "prompt_audio"


def test_speech_and_tones_pass_the_noise_check():
    speech = speech_like(2.0, 16000, seed=1)
    samples, rate = load_prompt_audio(wav(speech), "prompt_audio")
    assert rate == 16000 and samples.shape == (32000,)
    assert spectral_flatness(speech) < 0.3
    t = np.arange(16000) / 16000
    assert spectral_flatness(np.sin(2 * np.pi * 220 * t).astype(np.float32)) < 0.01


def test_undecodable_audio_names_the_field_without_an_object_repr():
    with pytest.raises(InvalidInput) as caught:
        load_prompt_audio(b"RIFF" + bytes(100), "audio")
    assert caught.value.field == "audio" and "0x" not in caught.value.problem and "BytesIO" not in str(caught.value)


def test_a_long_bad_id_is_echoed_short():
    with pytest.raises(InvalidInput) as caught:
        check_voice_id("x" * 10_000 + "!", "voice_id")
    assert len(str(caught.value)) < 200 and "10003 characters" in str(caught.value)
    assert short_repr(io.BytesIO()) == "a BytesIO"


def test_nan_and_inf_are_refused_at_model_boundaries():
    import torch

    from cosyvoice_triton.triton.finite import check_chunk_finite, check_finite

    assert check_finite("wav16k", np.zeros(4, np.float32)).shape == (4,)
    for bad in (np.array([0.0, np.nan], np.float32), torch.tensor([np.inf])):
        with pytest.raises(InvalidInput, match="NaN or infinite") as caught:
            check_finite("wav16k", bad)
        assert caught.value.field == "wav16k"

    class Prompt:
        mel, embedding = torch.zeros(1, 4, 80), torch.full((1, 192), float("nan"))

    class Chunk:
        prompt = Prompt()

    with pytest.raises(InvalidInput) as caught:
        check_chunk_finite(Chunk())
    assert caught.value.field == "embedding"


def test_the_prompt_budget_refuses_transcripts_that_leave_no_room_for_a_sentence(tiny_model_dir):
    from cosyvoice_triton.preprocess.text import TextPreprocessor
    from cosyvoice_triton.voices.prompt_budget import SENTENCE_ROOM, PromptBudget, speech_tokens_of

    budget = PromptBudget(4096, TextPreprocessor.from_model_dir(tiny_model_dir))
    assert speech_tokens_of(48000, 16000) == 75
    assert budget.transcript_limit(75) == 4096 - 2 - SENTENCE_ROOM - 75
    budget.check("a short transcript", 75, "reference_text")
    with pytest.raises(InvalidInput, match="characters long") as caught:  # capped before it is normalized
        budget.check(" ".join(["a long transcript that never ends"] * 300), 75, "reference_text")
    assert caught.value.field == "reference_text"
    with pytest.raises(InvalidInput, match="positions"):  # within the characters, over the positions
        dataclasses.replace(budget, max_seq_len=500).check(" ".join(["a long transcript"] * 100), 75,
                                                           "reference_text")
    with pytest.raises(InvalidInput):  # a smaller LLM cache leaves less room
        PromptBudget(400, budget.preprocessor).check("word " * 60, 750 // 10 * 2, "reference_text")
