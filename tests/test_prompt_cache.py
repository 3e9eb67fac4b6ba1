"""The voice's share of the flow, computed once (models/prompt_cache.py): a new stream of a prompt seen before
starts from the voice-final frames kept by the first stream, and its audio equals the audio with the prompt
cache off.

On the tiny golden folder's flow and HiFT, with random prompts of more than one 25-token chunk.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_triton.messages import FlowPrompt
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.flow_cache import FlowCacheSettings, StreamFlowCache
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import GeneratorNoise
from cosyvoice_triton.models.prompt_cache import PromptCache, prompt_key, voice_final_frames
from cosyvoice_triton.token2wav.stream import Token2Wav
from cosyvoice_triton.token2wav.scheduler import ChunkRequest, Token2WavScheduler

WAVE_ATOL = 1e-4  # as tests/test_flow_cache.py: the per-stream cache's bound
NO_PROMPT_CACHE = FlowCacheSettings(prompt_cache_mb=0)


def random_prompt(n_tokens: int, seed: int) -> FlowPrompt:
    g = torch.Generator().manual_seed(seed)
    return FlowPrompt(speech_tokens=torch.randint(0, 6561, (1, n_tokens), generator=g, dtype=torch.int32),
                      mel=torch.randn(1, 2 * n_tokens, 80, generator=g),
                      embedding=torch.randn(1, 192, generator=g))


def speech_tokens(n: int, seed: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, 6561, size=n).tolist()


def solo_audio(token2wav: Token2Wav, prompt: FlowPrompt, tokens: list[int], ends: list[int]) -> np.ndarray:
    stream = token2wav.stream(prompt, GeneratorNoise.seeded(3))
    bounds = [0] + ends + [len(tokens)]
    return np.concatenate([stream.chunk(tokens[a:b], finalize=b == len(tokens)) for a, b in zip(bounds, bounds[1:])])


def test_voice_final_frames(flow: FlowModel) -> None:
    """Whole 25-token chunks whose 3 look-ahead tokens are in the prompt, as 50-frame chunks."""
    frames = {n: voice_final_frames(flow, random_prompt(n, 0), 10 ** 6) for n in (27, 28, 60, 75, 80)}
    assert frames == {27: 0, 28: 50, 60: 100, 75: 100, 80: 150}
    assert voice_final_frames(flow, random_prompt(80, 0), 120) == 100  # the per-stream cap, in whole chunks


@pytest.mark.parametrize("n_prompt", [75, 80])  # 80: a prompt that is not a whole number of chunks
def test_second_stream_of_a_voice_starts_from_it_and_sounds_the_same(flow: FlowModel, hift: HiFTGenerator,
                                                                      n_prompt: int) -> None:
    prompt, tokens, ends = random_prompt(n_prompt, 1), speech_tokens(110, 1), [28, 78]
    want = solo_audio(Token2Wav(flow, hift, NO_PROMPT_CACHE), prompt, tokens, ends)
    token2wav = Token2Wav(flow, hift)
    first = solo_audio(token2wav, prompt, tokens, ends)
    cache = token2wav.prompt_cache
    assert len(cache) == 1 and cache.hits == 0 and cache.nbytes > 0
    (entry,) = cache._entries.values()
    assert entry.frames == voice_final_frames(flow, prompt, 10 ** 6) > 0
    before = [t.clone() for step in entry.steps for t in step]

    seeded = token2wav.new_flow_cache(prompt)
    assert seeded.frames == entry.frames and seeded.voice_key is None and cache.hits == 1
    second = solo_audio(token2wav, prompt, tokens, ends)
    assert cache.hits == 2 and len(cache) == 1
    for got in (first, second):
        assert got.shape == want.shape
        assert float(np.abs(got - want).max()) <= WAVE_ATOL
    # The kept tensors are shared by the seeded streams and never written.
    assert all(torch.equal(a, b) for a, b in zip(before, (t for step in entry.steps for t in step)))


def test_different_voices_never_share(flow: FlowModel, hift: HiFTGenerator) -> None:
    base = random_prompt(60, 2)
    other_mel = base.mel.clone()
    other_mel[0, 5, 7] += 1e-3
    variants = [base, FlowPrompt(base.speech_tokens, other_mel, base.embedding),
                FlowPrompt(base.speech_tokens, base.mel, base.embedding * 1.5),
                FlowPrompt(base.speech_tokens.flip(1), base.mel, base.embedding)]
    keys = {prompt_key(p, 100) for p in variants}
    assert len(keys) == len(variants)
    # The same content gives the same key whatever the container's dtype (the flow casts it the same way).
    same = FlowPrompt(base.speech_tokens.long(), base.mel.double().float(), base.embedding.clone())
    assert prompt_key(same, 100) == prompt_key(base, 100)

    token2wav = Token2Wav(flow, hift)
    tokens, ends = speech_tokens(60, 2), [28]
    for prompt in variants:
        want = solo_audio(Token2Wav(flow, hift, NO_PROMPT_CACHE), prompt, tokens, ends)
        got = solo_audio(token2wav, prompt, tokens, ends)
        assert float(np.abs(got - want).max()) <= WAVE_ATOL
    assert len(token2wav.prompt_cache) == len(variants) and token2wav.prompt_cache.hits == 0


def fake_voice(frames: int, mb: float) -> StreamFlowCache:
    return StreamFlowCache(frames, [[torch.zeros(int(mb * (1 << 20)) // 4)]])


def test_lru_evicts_by_bytes() -> None:
    cache = PromptCache.of_size_mb(2.5)
    for key in (b"a", b"b"):
        cache.store(key, fake_voice(50, 1.0))
    assert cache.seed(b"a") is not None  # "a" is now the most recently used
    cache.store(b"c", fake_voice(50, 1.0))  # 3 MB > 2.5: the least recently used ("b") goes
    assert set(cache._entries) == {b"a", b"c"} and cache.nbytes == 2 << 20
    cache.store(b"d", fake_voice(50, 3.0))  # larger than the whole cache: not kept, nothing evicted
    assert set(cache._entries) == {b"a", b"c"}
    cache.store(b"c", fake_voice(50, 1.0))  # stored again: counted once
    assert cache.nbytes == 2 << 20 and cache.seed(b"b") is None and cache.misses == 1


def test_zero_mb_is_off(flow: FlowModel, hift: HiFTGenerator) -> None:
    assert PromptCache.of_size_mb(0) is None
    token2wav = Token2Wav(flow, hift, NO_PROMPT_CACHE)
    assert token2wav.prompt_cache is None
    scheduler = Token2WavScheduler(flow, hift, flow_cache=NO_PROMPT_CACHE)
    prompt = random_prompt(75, 3)
    for _ in range(2):
        cache = token2wav.new_flow_cache(prompt)
        assert cache.frames == 0 and cache.voice_key is None
    tokens = speech_tokens(40, 3)
    scheduler.run([ChunkRequest("s", tokens[:28], finalize=False, prompt=prompt, seed=1)])
    assert scheduler.stats.prompt_cache_bytes == 0 and scheduler.stats.prompt_cache_hits == 0
    with pytest.raises(ValueError):
        PromptCache.of_size_mb(-1)


def test_batched_streams_of_shared_and_new_voices(flow: FlowModel, hift: HiFTGenerator) -> None:
    """Through the scheduler: "a" fills voice 1; then one flow call holds a seeded stream of voice 1, a new
    voice's first chunk and "a"'s next chunk; every stream's audio equals the prompt cache off."""
    voice1, voice2 = random_prompt(75, 4), random_prompt(60, 5)
    tokens = {"a": speech_tokens(100, 6), "b": speech_tokens(80, 7), "c": speech_tokens(70, 8)}
    prompts = {"a": voice1, "b": voice1, "c": voice2}
    rounds = [[("a", 0, 28)], [("a", 28, 78), ("b", 0, 28), ("c", 0, 28)],
              [("a", 78, 100), ("b", 28, 80), ("c", 28, 70)]]

    def run(settings: FlowCacheSettings) -> tuple[dict[str, np.ndarray], Token2WavScheduler]:
        scheduler = Token2WavScheduler(flow, hift, flow_cache=settings, clock=lambda: 0.0)
        audio: dict[str, list[np.ndarray]] = {sid: [] for sid in tokens}
        for batch in rounds:
            chunks = [ChunkRequest(sid, tokens[sid][a:b], finalize=b == len(tokens[sid]),
                                   prompt=prompts[sid] if a == 0 else None, seed=9) for sid, a, b in batch]
            for chunk, samples in zip(chunks, scheduler.run(chunks)):
                assert isinstance(samples, np.ndarray), samples
                audio[chunk.stream_id].append(samples)
        return {sid: np.concatenate(parts) for sid, parts in audio.items()}, scheduler

    want, _ = run(NO_PROMPT_CACHE)
    got, scheduler = run(FlowCacheSettings())
    stats = scheduler.stats
    assert stats.prompt_cache_hits == 1 and len(scheduler.prompt_cache) == 2 and stats.prompt_cache_bytes > 0
    assert stats.max_flow_batch == 3
    for sid in tokens:
        assert got[sid].shape == want[sid].shape
        assert float(np.abs(got[sid] - want[sid]).max()) <= WAVE_ATOL, sid


def test_prompt_cache_mb_reaches_the_served_token2wav(tmp_path) -> None:
    """serve/up --prompt-cache-mb MB: the token2wav template carries it and its parameters parse it."""
    import pb_fake
    from cosyvoice_triton.cli import build_parser
    from cosyvoice_triton.server.launcher import DEFAULT_REPOSITORY, ServeOptions, repository_values
    from cosyvoice_triton.server.templates import render_template
    from cosyvoice_triton.triton.params import Token2WavParams, parse_parameters

    args = build_parser().parse_args(["serve", "--prompt-cache-mb", "64"])
    assert args.prompt_cache_mb == 64.0
    values = repository_values(ServeOptions(prompt_cache_mb=args.prompt_cache_mb), tmp_path, "v.sqlite")["token2wav"]
    template = (DEFAULT_REPOSITORY / "token2wav" / "config.pbtxt").read_text()
    config = pb_fake.pbtxt_to_dict(render_template(template, values, name="token2wav"))
    assert parse_parameters(Token2WavParams, config, "token2wav").prompt_cache_mb == 64.0
