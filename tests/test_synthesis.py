"""The in-process pipeline on a tiny random folder (`cosyvoice-triton export`): every mode, offline and streaming."""
from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_triton.errors import Cancelled, InvalidInput
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.preprocess.audio import load_prompt_audio
from cosyvoice_triton.messages import SynthesisRequest
from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2

SAMPLES_PER_TOKEN = 960  # 2 mel frames x 480 samples at 24 kHz


@pytest.fixture(scope="module")
def tts(tiny_model_dir) -> CosyVoice2:
    return CosyVoice2.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def voice(tts, prompt_wav_16k):
    samples, rate = prompt_wav_16k
    return tts.encode_voice(samples, rate, "今天天气真不错")


def synth(tts, voice, text="你好。", stream=False, **kw) -> list[np.ndarray]:
    return list(tts.synthesize(SynthesisRequest(text=text, voice=voice, seed=kw.pop("seed", 7), **kw), stream=stream))


@pytest.mark.parametrize("mode,extra", [("zero_shot", {}), ("cross_lingual", {}),
                                        ("instruct2", {"instruct_text": "用开心的语气说"})])
def test_every_mode_offline(tts, voice, mode, extra):
    chunks = synth(tts, voice, "你好，世界。", mode=mode, **extra)
    audio = np.concatenate(chunks)
    assert audio.dtype == np.float32 and np.isfinite(audio).all()
    assert audio.size > 0 and audio.size % 480 == 0
    assert np.abs(audio).max() <= 0.99 + 1e-6  # HiFT's audio limit


def test_modes_give_different_llm_prompts(tts, voice):
    request = SynthesisRequest(text="hello", voice=voice, seed=1)
    zero_shot = tts.pipeline.llm_requests(request, "r", 1)[0]
    request.mode = "cross_lingual"
    cross = tts.pipeline.llm_requests(request, "r", 1)[0]
    request.mode, request.instruct_text = "instruct2", "Speak slowly."
    instruct = tts.pipeline.llm_requests(request, "r", 1)[0]
    assert zero_shot.prompt_speech_tokens == [int(t) for t in voice.speech_tokens]
    assert zero_shot.prompt_text_tokens and not cross.prompt_text_tokens and not cross.prompt_speech_tokens
    end_of_prompt = tts.preprocessor.tokenizer.token_to_id("<|endofprompt|>")
    assert instruct.prompt_text_tokens[-1] == end_of_prompt and not instruct.prompt_speech_tokens
    assert zero_shot.text_tokens == cross.text_tokens == instruct.text_tokens


def test_streaming_gives_growing_chunks_of_the_offline_length(tts, voice):
    offline = synth(tts, voice, "你好，欢迎使用。", stream=False)
    streamed = synth(tts, voice, "你好，欢迎使用。", stream=True)
    assert len(offline) == 1 and len(streamed) >= 3
    # same seed: same tokens, so the same total length; the first chunk is the smallest non-final one
    assert sum(c.size for c in streamed) == offline[0].size
    assert streamed[0].size < streamed[1].size


def test_same_seed_same_audio_other_seed_other_audio(tts, voice):
    a, b = np.concatenate(synth(tts, voice, seed=3)), np.concatenate(synth(tts, voice, seed=3))
    c = np.concatenate(synth(tts, voice, seed=4))
    assert np.array_equal(a, b)
    assert a.shape != c.shape or not np.allclose(a, c)


def test_long_text_is_split_into_sentences_spoken_in_order(tts, voice):
    text = "这是第一句话，我们说得比较长一些，为了测试分句的功能是否正常。" * 4
    sentences = tts.preprocessor.split(text)
    assert len(sentences) > 1
    chunks = synth(tts, voice, text)
    assert len(chunks) == len(sentences)


def test_cancel_mid_stream_stops_and_frees_state(tts, voice):
    calls = {"n": 0}

    def cancelled() -> bool:
        calls["n"] += 1
        return calls["n"] > 40

    request = SynthesisRequest(text="你好，欢迎使用语音合成。", voice=voice, seed=1)
    got = []
    with pytest.raises(Cancelled):
        for chunk in tts.synthesize(request, stream=True, is_cancelled=cancelled):
            got.append(chunk)
    assert tts.pipeline.token2wav.streams == {}
    assert synth(tts, voice)  # still serves


@pytest.mark.parametrize("text", ["", "   \n\t"])
def test_empty_text_is_rejected(tts, voice, text):
    with pytest.raises(InvalidInput, match="target_text"):
        synth(tts, voice, text)


def test_too_long_text_is_rejected(tts, voice):
    with pytest.raises(InvalidInput, match="target_text"):
        synth(tts, voice, "很" * 100_000)


def test_request_fields_are_validated(tts, voice):
    with pytest.raises(InvalidInput, match="mode"):
        synth(tts, voice, mode="sing")
    with pytest.raises(InvalidInput, match="instruct_text"):
        synth(tts, voice, mode="instruct2")
    voice_without_text = type(voice)(**{**voice.__dict__, "text": ""})
    with pytest.raises(InvalidInput, match="reference_text"):
        synth(tts, voice_without_text, mode="zero_shot")
    assert synth(tts, voice_without_text, mode="cross_lingual")


def wav_bytes(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.mark.parametrize("samples,problem", [
    (np.zeros(48000, dtype=np.float32), "silent"),
    (speech_like(0.3, 16000), "at least 0.5 s"),
    (speech_like(31.0, 16000), "at most 30 s"),
])
def test_bad_prompt_audio_is_rejected(samples, problem):
    with pytest.raises(InvalidInput, match="reference_wav") as err:
        load_prompt_audio(wav_bytes(samples, 16000), field="reference_wav")
    assert problem in str(err.value)


def test_corrupt_and_nan_prompt_audio_is_rejected():
    with pytest.raises(InvalidInput, match="reference_wav"):
        load_prompt_audio(b"RIFF\x00\x00not really a wav at all", field="reference_wav")
    with pytest.raises(InvalidInput, match="reference_wav"):
        load_prompt_audio(b"\x89PNG\r\n\x1a\n" + bytes(200), field="reference_wav")
    samples = speech_like(2.0, 16000)
    samples[100] = np.nan
    with pytest.raises(InvalidInput, match="reference_wav"):
        load_prompt_audio(wav_bytes(samples, 16000, "WAV", "FLOAT"), field="reference_wav")


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_other_sample_rates_are_resampled(tts, rate):
    samples, got_rate = load_prompt_audio(wav_bytes(speech_like(2.0, rate), rate, "FLAC"), field="reference_wav")
    assert got_rate == rate
    voice = tts.encode_voice(samples, got_rate, "你好")
    assert voice.mel.shape == (2 * voice.speech_tokens.size, 80)
    assert voice.speech_tokens.size > 0
