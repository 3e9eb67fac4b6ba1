"""Speaking speed: the mel interpolated along time by 1 / speed before the vocoder (token2wav/speed.py),
offline as the official `F.interpolate`, streamed chunk by chunk, through the token2wav scheduler and the
in-process library. (Served audio at a speed: test_openai_api.py and the routes' tests.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import MAX_SPEED, MIN_SPEED, ChunkRequest, SynthesisRequest, check_speed
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import GeneratorNoise, ZeroNoise
from cosyvoice_triton.token2wav.speed import MelSpeed, SpeedState
from cosyvoice_triton.token2wav.vocoder_stream import VocoderStream


def stretch_in_chunks(speed: float, mel: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    stretcher, state, pieces = MelSpeed(speed), SpeedState(), []
    bounds = [0, *cuts, mel.shape[2]]
    for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
        finalize = k == len(bounds) - 2
        expected = stretcher.output_frames(state, end - start, finalize)
        piece, state = stretcher.stretch(state, mel[:, :, start:end], finalize)
        assert piece.shape[2] == expected
        pieces.append(piece)
    return torch.cat(pieces, dim=2)


@pytest.mark.parametrize("speed", [0.5, 0.8, 1.5, 2.0, 3.7])
def test_one_chunk_is_the_official_interpolation(speed: float):
    mel = torch.randn(1, 80, 97)
    out, _ = MelSpeed(speed).stretch(SpeedState(), mel, finalize=True)
    assert torch.equal(out, F.interpolate(mel, size=int(97 / speed), mode="linear"))


@pytest.mark.parametrize("speed", [0.5, 0.8, 1.5, 2.0, 3.7])
def test_chunks_make_one_continuous_interpolation(speed: float):
    """Chunk boundaries change nothing: the chunked stretch equals one interpolation at scale `speed`
    over the whole mel (what F.interpolate gives with scale_factor 1 / speed), with the official count."""
    mel = torch.randn(1, 80, 120)
    whole = F.interpolate(mel, scale_factor=1 / speed, mode="linear", recompute_scale_factor=False)
    chunked = stretch_in_chunks(speed, mel, [30, 31, 70])
    n = int(120 / speed)
    assert chunked.shape[2] == n
    common = min(n, whole.shape[2])
    torch.testing.assert_close(chunked[:, :, :common], whole[:, :, :common], rtol=0, atol=1e-4)  # its positions are fp32


def test_speed_one_passes_mel_through():
    mel = torch.randn(1, 80, 20)
    out, state = MelSpeed(1.0).stretch(SpeedState(), mel, finalize=False)
    assert out is mel and state == SpeedState()


@pytest.mark.parametrize("bad", [0.2, 4.5, 0, -1, float("nan"), True, "1.5", None])
def test_speed_outside_the_range_is_refused_naming_it(bad):
    with pytest.raises(InvalidInput) as caught:
        check_speed(bad)
    assert caught.value.field == "speed"
    assert check_speed(MIN_SPEED) == MIN_SPEED and check_speed(MAX_SPEED) == MAX_SPEED


@pytest.fixture(scope="module")
def hift(golden_model_dir: Path) -> HiFTGenerator:
    return HiFTGenerator.from_model_dir(golden_model_dir)


def test_vocoder_stream_at_speed_has_the_stretched_length(hift: HiFTGenerator, golden: dict[str, np.ndarray]):
    mel = torch.from_numpy(golden["hift_in_mel"])  # (1, 80, T)
    T, hop = mel.shape[2], hift.config.samples_per_frame
    offline = VocoderStream(hift, noise=ZeroNoise(), speed=1.5).push(mel, finalize=True)
    assert offline.shape[1] == int(T / 1.5) * hop
    streamed = VocoderStream(hift, noise=ZeroNoise(), speed=1.5)
    chunks = torch.tensor_split(mel, 3, dim=2)
    audio = torch.cat([streamed.push(c, finalize=i == 2) for i, c in enumerate(chunks)], dim=1)
    assert audio.shape[1] == int(T / 1.5) * hop
    assert VocoderStream(hift, noise=ZeroNoise()).push(mel, finalize=True).shape[1] == T * hop


def test_too_short_first_chunk_at_speed_names_speed(hift: HiFTGenerator):
    stream = VocoderStream(hift, noise=ZeroNoise(), speed=4.0)
    with pytest.raises(InvalidInput) as caught:
        stream.check_chunk(16, finalize=False)  # 16 frames become 4 < 8 held back
    assert caught.value.field == "speed"
    stream.check_chunk(40, finalize=False)  # 10 frames: enough
    stream.check_chunk(4, finalize=True)  # a final chunk holds nothing back


@pytest.fixture(scope="module")
def token2wav_pair(golden_model_dir: Path, hift: HiFTGenerator):
    from cosyvoice_triton.models.flow import FlowModel

    return FlowModel.from_model_dir(golden_model_dir), hift


@pytest.fixture(scope="module")
def golden_prompt_tokens(golden: dict[str, np.ndarray]):
    from cosyvoice_triton.messages import FlowPrompt

    prompt = FlowPrompt(speech_tokens=golden["in_prompt_speech_token"][:, :20], mel=golden["in_prompt_feat"][:, :40],
                        embedding=golden["in_embedding"])
    return prompt, golden["flow_token"][0].tolist()  # 90 tokens


def test_scheduler_streams_at_speed_equal_the_solo_stream(token2wav_pair, golden_prompt_tokens):
    """The batched scheduler applies each stream's speed as the solo Token2WavStream does; streams of
    other speeds in the same batch do not change it."""
    from cosyvoice_triton.token2wav.stream import Token2Wav
    from cosyvoice_triton.token2wav.scheduler import Token2WavScheduler

    flow, hift = token2wav_pair
    prompt, tokens = golden_prompt_tokens
    tokens = tokens[:60]  # three chunks of 20, 15 and 25 tokens: enough for the length ratios, 2/3 of the flow work
    scheduler = Token2WavScheduler(flow, hift)
    cuts = [(0, 20, False), (20, 35, False), (35, len(tokens), True)]
    batched = {speed: [] for speed in (1.0, 1.5, 0.7)}
    for start, end, finalize in cuts:
        chunks = [ChunkRequest(f"s{speed}", tokens[start:end], finalize, prompt if start == 0 else None, seed=3,
                               speed=speed) for speed in batched]
        for speed, audio in zip(batched, scheduler.run(chunks)):
            assert isinstance(audio, np.ndarray), audio
            batched[speed].append(audio)
    lengths = {}
    for speed, pieces in batched.items():
        solo = Token2Wav(flow, hift).stream(prompt, GeneratorNoise.seeded(3), speed=speed)
        expected = [solo.chunk(tokens[start:end], finalize) for start, end, finalize in cuts]
        for got, want in zip(pieces, expected):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)
        lengths[speed] = sum(p.size for p in pieces)
    assert abs(lengths[1.5] / lengths[1.0] - 1 / 1.5) < 0.03
    assert abs(lengths[0.7] / lengths[1.0] - 1 / 0.7) < 0.03
    assert scheduler.stats.active_streams == 0


def test_synthesis_request_checks_speed():
    voice = pytest.importorskip("cosyvoice_triton.messages").PromptFeatures(
        embedding=np.zeros(192, np.float32), speech_tokens=np.zeros(4, np.int32), mel=np.zeros((8, 80), np.float32),
        text="hi", audio_sha256="x")
    with pytest.raises(InvalidInput) as caught:
        SynthesisRequest(text="hello", voice=voice, speed=5.0).validate()
    assert caught.value.field == "speed"
