"""CosyVoice3 through the pipeline's token2wav path, on the tiny CosyVoice3 golden folder.

End to end against the official outputs: the golden set's `e2e_*` arrays are `CosyVoice3Model.tts` on fixed
tokens (its voice-conversion entry, vocoder noise zeroed), which is what the pipeline's voice conversion runs:
the chunk schedule and sender, then token2wav with the DiT cache and the windowed causal vocoder, through the
single-stream stage and through the batching scheduler, streamed and offline. Then what serving adds: streams
batched in one flow call give each stream its solo audio bits (a cancelled stream beside them leaves nothing
behind), the DiT cache changes no audio beyond float rounding and is sized by the family's default, and
speed stretches the mel (offline: the official `F.interpolate`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cosyvoice_triton.family import COSYVOICE3
from cosyvoice_triton.messages import ChunkPolicy, ChunkRequest, ConversionRequest, FlowPrompt, PromptFeatures
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.flow_cache import FlowCacheSettings
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule
from cosyvoice_triton.pipeline.local_stages import BatchingToken2WavStage, ReferenceToken2Wav
from cosyvoice_triton.pipeline.threads import CoreShare, RowWorkers, ThreadPlan
from cosyvoice_triton.pipeline.voice_conversion import VoiceConverter
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.token2wav.scheduler import Token2WavScheduler
from cosyvoice_triton.token2wav.stream import Token2Wav

from golden_checks import E2E_ATOL, indexed

GOLDEN = Path(__file__).resolve().parent / "golden" / "cv3" / "tiny"
CACHE_ATOL = 1e-5  # cached against uncached flow calls: float summation order only (measured ~1e-6)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN / "golden.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def models():
    """(flow, vocoder) of the golden folder; the vocoder's fixed noise zeroed, as the e2e arrays were made."""
    folder = GOLDEN / "model"
    family = family_models(folder)
    vocoder = family.load_vocoder(folder)
    vocoder.noise = ZeroNoise()
    return family.load_flow(folder), vocoder


def golden_voice(golden: dict) -> PromptFeatures:
    return PromptFeatures(embedding=golden["in_embedding"][0], speech_tokens=golden["in_prompt_speech_token"][0],
                          mel=golden["in_prompt_feat"][0], text="", audio_sha256="golden")


def convert(stage, golden: dict, stream: bool) -> list[np.ndarray]:
    """The pipeline's voice conversion with the golden tokens in place of the source's (one piece)."""
    tokens = golden["flow_token"][0]
    converter = VoiceConverter(lambda wav16k: tokens, stage)
    request = ConversionRequest(source=speech_like(1.0, 16000, seed=1), sample_rate=16000, voice=golden_voice(golden),
                                seed=5)
    return list(converter.run(request, stream=stream))


@pytest.fixture(params=["reference", "scheduler"])
def stage(request, models):
    flow, vocoder = models
    if request.param == "reference":
        yield ReferenceToken2Wav(Token2Wav(flow, vocoder))
        return
    batching = BatchingToken2WavStage(Token2WavScheduler(flow, vocoder), max_batch=4, queue_delay_s=0.0)
    yield batching
    assert batching.scheduler.stats.active_streams == 0
    batching.close()


def test_the_pipeline_reproduces_the_official_streaming_chunks_and_offline_audio(stage, golden: dict) -> None:
    streamed = convert(stage, golden, stream=True)
    expected = [chunk[0] for chunk in indexed(golden, "e2e_stream_chunk")]
    assert [c.shape for c in streamed] == [c.shape for c in expected]  # the official schedule: 33, 83, the rest
    for got, want in zip(streamed, expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=E2E_ATOL)
    (offline,) = convert(stage, golden, stream=False)
    np.testing.assert_allclose(offline, golden["e2e_nonstream"][0], rtol=0, atol=E2E_ATOL)


def chunks_of(stream_id: str, prompt: FlowPrompt, tokens: list[int], policy: ChunkPolicy) -> list[ChunkRequest]:
    schedule, ends = ChunkSchedule(policy, prompt.speech_tokens.shape[1]), [0]
    while schedule.needed <= len(tokens):
        ends.append(schedule.advance()[1])
    spans = list(zip(ends, ends[1:] + [len(tokens)]))
    return [ChunkRequest(stream_id, tokens[a:b], finalize=j == len(spans) - 1, prompt=prompt if j == 0 else None,
                         seed=None) for j, (a, b) in enumerate(spans)]


def test_batched_streams_give_their_solo_bits_and_a_cancelled_one_leaves_nothing(models, golden: dict) -> None:
    flow, vocoder = models
    rng = np.random.RandomState(3)
    prompt = FlowPrompt(golden["in_prompt_speech_token"], golden["in_prompt_feat"], golden["in_embedding"])
    other = FlowPrompt(golden["in_prompt_speech_token"][:, :12], golden["in_prompt_feat"][:, :24],
                       rng.randn(1, 192).astype(np.float32))
    policy = ChunkPolicy(first_hop=8, hop_scale=1.0, align_to_chunk=False)  # a chunk every 8 tokens
    chunks = {"a": chunks_of("a", prompt, golden["flow_token"][0, :40].tolist(), policy),
              "b": chunks_of("b", other, rng.randint(0, 6561, 30).tolist(), policy),
              "gone": chunks_of("gone", other, rng.randint(0, 6561, 30).tolist(), policy)}
    workers = RowWorkers(CoreShare(ThreadPlan(cores=2, llm=1, token2wav=1)))

    def scheduler() -> Token2WavScheduler:
        return Token2WavScheduler(flow, vocoder, map_rows=workers.map)

    try:
        alone = {}
        for sid in ("a", "b"):
            single = scheduler()
            alone[sid] = np.concatenate([single.run([chunk])[0] for chunk in chunks[sid]])
        together, got = scheduler(), {"a": [], "b": []}
        waiting = {sid: list(c) for sid, c in chunks.items()}
        for call in range(100):
            batch = [waiting[sid].pop(0) for sid in waiting if waiting[sid] and (sid != "b" or call >= 1)]
            if call == 2:  # "gone" leaves after two chunks: its client cancelled
                batch = [chunk for chunk in batch if chunk.stream_id != "gone"]
                assert together.cancel("gone") and not together.cancel("gone")
                waiting["gone"] = []
            if not batch:
                break
            for chunk, audio in zip(batch, together.run(batch)):
                assert isinstance(audio, np.ndarray), audio
                if chunk.stream_id in got:
                    got[chunk.stream_id].append(audio)
            if call == 1:
                assert together.stats.flow_cache_bytes > 0  # the DiT caches of the live streams
        stats = together.stats
        assert stats.max_flow_batch == 3 and stats.active_streams == 0 and stats.flow_cache_bytes == 0
        assert stats.freed["cancel"] == 1 and stats.freed["finalize"] == 2
    finally:
        workers.close()
    for sid, audio in alone.items():
        assert np.array_equal(np.concatenate(got[sid]), audio), sid


def test_the_dit_cache_changes_no_audio_and_has_the_family_default_size(models, golden: dict) -> None:
    flow, vocoder = models
    prompt = FlowPrompt(golden["in_prompt_speech_token"], golden["in_prompt_feat"], golden["in_embedding"])
    tokens = golden["flow_token"][0].tolist()

    def streamed(settings: FlowCacheSettings) -> np.ndarray:
        token2wav = Token2Wav(flow, vocoder, settings)
        stream = token2wav.stream(prompt, token2wav.noise(1))
        return np.concatenate([stream.chunk(c.tokens, c.finalize) for c in chunks_of("x", prompt, tokens, ChunkPolicy())])

    cached = Token2Wav(flow, vocoder)
    assert cached.flow_cache.max_frames == COSYVOICE3.flow_cache_frames
    assert cached.noise(7) is None  # the vocoder's fixed noise: the seed does not reach it
    np.testing.assert_allclose(streamed(FlowCacheSettings()), streamed(FlowCacheSettings(enabled=False)),
                               rtol=0, atol=CACHE_ATOL)


def test_speed_stretches_the_mel_offline_as_the_official_and_streamed(models, golden: dict) -> None:
    flow, vocoder = models
    prompt = FlowPrompt(golden["in_prompt_speech_token"], golden["in_prompt_feat"], golden["in_embedding"])
    tokens = golden["flow_token"][0].tolist()
    token2wav = Token2Wav(flow, vocoder)
    offline = token2wav.stream(prompt, None, speed=1.5).chunk(tokens, finalize=True)
    mel = torch.from_numpy(golden["flow_mel_nonstream"])
    want, _ = vocoder.inference(F.interpolate(mel, size=int(mel.shape[2] / 1.5), mode="linear"))
    np.testing.assert_allclose(offline, want[0].numpy(), rtol=0, atol=E2E_ATOL)
    stream = token2wav.stream(prompt, None, speed=1.5)
    streamed = [stream.chunk(c.tokens, c.finalize) for c in chunks_of("x", prompt, tokens, ChunkPolicy())]
    assert len(streamed) == 3 and sum(c.size for c in streamed) == offline.size


def test_a_stream_without_tokens_is_silent_in_both_stages(models, golden: dict) -> None:
    """CosyVoice3's LLM may stop at its first step (min_len holds back SOS, not its stop ids): no audio."""
    flow, vocoder = models
    prompt = FlowPrompt(golden["in_prompt_speech_token"], golden["in_prompt_feat"], golden["in_embedding"])
    token2wav = Token2Wav(flow, vocoder)
    assert token2wav.stream(prompt, None).chunk([], finalize=True).size == 0
    scheduler = Token2WavScheduler(flow, vocoder)
    (audio,) = scheduler.run([ChunkRequest("empty", [], finalize=True, prompt=prompt, seed=None)])
    assert audio.size == 0 and scheduler.stats.active_streams == 0
