"""Per-stream DiT caches (models/dit_cache.py): a cached CosyVoice3 streaming call computes only the frames
after the stream's complete attention chunks, and its mel equals the official full re-run's.

On the tiny CosyVoice3 golden folder: the golden streaming chunks, a longer random stream on the official
schedule and on one whose chunks end inside attention chunks, both ways of running the rows (one padded
pass, or a pass per row), two streams interleaved and batched, and a cache from another stream (which must
change the mel: the checks above would catch stale keys).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.family import COSYVOICE3
from cosyvoice_triton.messages import FlowPrompt
from cosyvoice_triton.models.dit_cache import cached_mel, supports_cache
from cosyvoice_triton.models.dit_flow import DiTFlowModel
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.flow import FlowConditions
from cosyvoice_triton.models.flow_cache import StreamFlowCache
from cosyvoice_triton.models.prompt_cache import PromptCache, voice_final_frames
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule

GOLDEN = Path(__file__).resolve().parent / "golden" / "cv3" / "tiny"
MEL_ATOL = 1e-4  # against the official outputs (the golden README)
CACHED_ATOL = 1e-5  # cached against our own uncached calls: float summation order only (measured ~1e-6)
MAX_FRAMES = 1000


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sequential(fn, rows):
    """A `map_rows` that runs the rows one after another."""
    return [fn(row) for row in rows]


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN / "golden.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def flow() -> DiTFlowModel:
    return family_models(GOLDEN / "model").load_flow(GOLDEN / "model")


def voice(golden: dict, start: int = 0, stop: int | None = None) -> FlowPrompt:
    tokens = golden["in_prompt_speech_token"][:, start:stop]
    return FlowPrompt(speech_tokens=torch.from_numpy(tokens),
                      mel=torch.from_numpy(golden["in_prompt_feat"][:, 2 * start:2 * start + 2 * tokens.shape[1]]),
                      embedding=torch.from_numpy(golden["in_embedding"]))


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.RandomState(seed).randint(0, 6561, size=(1, n)).astype(np.int32))


def official_ends(flow: DiTFlowModel, prompt: FlowPrompt, n_tokens: int) -> list[int]:
    """The token counts of the non-final calls of the official schedule."""
    config = flow.config
    policy = replace(COSYVOICE3.chunk, lookahead=config.pre_lookahead_len,
                     chunk_tokens=config.estimator.static_chunk_size // config.token_mel_ratio)
    schedule, ends = ChunkSchedule(policy, prompt.speech_tokens.shape[1]), []
    while schedule.needed <= n_tokens:
        ends.append(schedule.advance()[1])
    return ends


def conditions(flow: DiTFlowModel, prompt: FlowPrompt, tokens: torch.Tensor, final: bool):
    """One row's conditions, as the official streams: chunk attention and the look-ahead held back until the
    final call, which attends fully."""
    length = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    return flow.conditions(tokens, length(tokens.shape[1]), prompt.speech_tokens, length(prompt.speech_tokens.shape[1]),
                           prompt.mel, length(prompt.mel.shape[1]), prompt.embedding, streaming=not final,
                           finalize=final)


def official_stream(flow: DiTFlowModel, prompt: FlowPrompt, tokens: torch.Tensor, ends: list[int]) -> list[torch.Tensor]:
    """The official way: every call runs the flow on all tokens so far; each keeps the frames after the last
    call's (the look-ahead's frames come with the next call)."""
    mels, offset, ratio = [], 0, flow.config.token_mel_ratio
    for end in ends + [tokens.shape[1]]:
        final = end == tokens.shape[1]
        length = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
        mel = flow.inference(tokens[:, :end], length(end), prompt.speech_tokens, length(prompt.speech_tokens.shape[1]),
                             prompt.mel, length(prompt.mel.shape[1]), prompt.embedding, streaming=not final,
                             finalize=final)
        mels.append(mel[:, :, ratio * offset:])
        offset = end - flow.config.pre_lookahead_len
    return mels


class CachedStream:
    """One stream's calls through `cached_mel`, as a token2wav stage makes them."""

    def __init__(self, flow: DiTFlowModel, prompt: FlowPrompt, tokens: torch.Tensor, map_rows=None):
        self.flow, self.prompt, self.tokens, self.map_rows = flow, prompt, tokens, map_rows
        self.cache: StreamFlowCache | None = StreamFlowCache()
        self.offset = 0
        self.computed: list[int] = []  # estimator frames per call
        self.cached: list[int] = []  # cached frames after each call

    def call(self, end: int) -> torch.Tensor:
        """The frames after the last call's, with the tokens up to `end`."""
        final = end == self.tokens.shape[1]
        c = conditions(self.flow, self.prompt, self.tokens[:, :end], final)
        mel, (start,), (kept,), _ = cached_mel(self.flow, c, [self.cache], [int(c.mel_len[0])], MAX_FRAMES,
                                               map_rows=self.map_rows)
        self.cache = None if final else kept
        self.computed.append(int(c.mel_len[0]) - start)
        self.cached.append(0 if final else kept.frames)
        first = self.prompt.mel.shape[1] + self.flow.config.token_mel_ratio * self.offset - start
        self.offset = end - self.flow.config.pre_lookahead_len
        return mel[:, :, first:int(c.mel_len[0]) - start]

    def run(self, ends: list[int]) -> list[torch.Tensor]:
        return [self.call(end) for end in ends + [self.tokens.shape[1]]]


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert [m.shape for m in got] == [m.shape for m in want]
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


def test_the_flow_supports_the_cache(flow: DiTFlowModel) -> None:
    assert supports_cache(flow)


@pytest.mark.parametrize("map_rows", [None, sequential], ids=["one-pass", "by-row"])
def test_cached_stream_equals_the_golden_chunks(flow: DiTFlowModel, golden: dict, map_rows) -> None:
    prompt, tokens = voice(golden), torch.from_numpy(golden["flow_token"])
    ends = golden["flow_stream_chunk_token_ends"].tolist()
    assert ends == official_ends(flow, prompt, tokens.shape[1])
    stream = CachedStream(flow, prompt, tokens, map_rows)
    got = stream.run(ends)
    ratio, offsets = flow.config.token_mel_ratio, golden["flow_stream_chunk_token_offsets"].tolist()
    want = [golden[f"flow_mel_stream_chunk{i}"][:, :, ratio * offset:] for i, offset in enumerate(offsets)]
    want.append(golden["flow_mel_nonstream"][:, :, ratio * (ends[-1] - flow.config.pre_lookahead_len):])
    assert max_error(got, [torch.from_numpy(m) for m in want]) <= MEL_ATOL
    # Prompt 40 frames + 60, then + 100: whole 50-frame chunks; the final call attends fully, computing all.
    assert stream.cached == [100, 200, 0] and stream.computed == [100, 100, 220]


@pytest.mark.parametrize("map_rows", [None, sequential], ids=["one-pass", "by-row"])
@pytest.mark.parametrize("schedule", ["official", "uneven"])
def test_cached_stream_equals_the_full_rerun(flow: DiTFlowModel, golden: dict, map_rows, schedule: str) -> None:
    """A longer stream. The uneven chunks end inside attention chunks: their last frames are computed again
    by the next call (with the keys of frames that the earlier call had not yet)."""
    prompt, tokens = voice(golden, 0, 17), random_tokens(260, 7)
    ends = official_ends(flow, prompt, tokens.shape[1]) if schedule == "official" else [28, 61, 97, 140, 203]
    want = official_stream(flow, prompt, tokens, ends)
    stream = CachedStream(flow, prompt, tokens, map_rows)
    assert max_error(stream.run(ends), want) <= CACHED_ATOL
    prompt_frames = prompt.mel.shape[1]
    mel_lens = [prompt_frames + 2 * (end - 3) for end in ends]
    assert stream.cached[:-1] == [n // 50 * 50 for n in mel_lens]  # complete chunks only
    assert stream.computed[:-1] == [n - c for n, c in zip(mel_lens, [0] + stream.cached[:-2])]
    assert sum(stream.computed[:-1]) < sum(mel_lens)


def test_two_streams_interleaved_equal_each_alone(flow: DiTFlowModel, golden: dict) -> None:
    """Streams of other voices and lengths, their calls interleaved, then all in one call: each equals its solo
    run; a stream's cache is never written by another's calls."""
    specs = [(voice(golden, 0, 20), random_tokens(150, 1), [33, 83]),
             (voice(golden, 4, 20), random_tokens(120, 2), [40, 61])]
    alone = [CachedStream(flow, prompt, tokens).run(ends) for prompt, tokens, ends in specs]

    streams = [CachedStream(flow, prompt, tokens) for prompt, tokens, _ in specs]
    interleaved: list[list[torch.Tensor]] = [[], []]
    for step in range(3):
        old = [t for slots in streams[0].cache.steps for t in slots]
        snapshot = [t.clone() for t in old]
        for i, (stream, (_, tokens, ends)) in enumerate(zip(streams, specs)):
            interleaved[i].append(stream.call((ends + [tokens.shape[1]])[step]))
        assert all(torch.equal(a, b) for a, b in zip(old, snapshot))  # never written in place, by either stream
    for got, want in zip(interleaved, alone):
        assert all(torch.equal(a, b) for a, b in zip(got, want))

    # One call per step for both streams: rows of other cache lengths, and stream 1's full-attention final
    # call beside stream 0's cached one.
    caches, offsets, batched = [StreamFlowCache(), StreamFlowCache()], [0, 0], [[], []]
    for step in range(3):
        rows = []
        for i, (prompt, tokens, ends) in enumerate(specs):
            end = (ends + [tokens.shape[1]])[step]
            rows.append(conditions(flow, prompt, tokens[:, :end], end == tokens.shape[1]))
        c = batch_conditions(rows)
        mel, starts, kept, _ = cached_mel(flow, c, caches, c.mel_len.tolist(), MAX_FRAMES)
        for i, (prompt, tokens, ends) in enumerate(specs):
            first = prompt.mel.shape[1] + 2 * offsets[i] - starts[i]
            batched[i].append(mel[i:i + 1, :, first:int(c.mel_len[i]) - starts[i]])
            offsets[i] = (ends + [tokens.shape[1]])[step] - 3
        caches = kept
    for got, want in zip(batched, alone):
        assert max_error(got, want) <= CACHED_ATOL


def batch_conditions(rows):
    """Single-row conditions stacked into one batch (right-padded), as `conditions` of a padded batch makes."""
    width = max(int(c.mu.shape[2]) for c in rows)
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[2]))  # noqa: E731
    return FlowConditions(
        mu=torch.cat([pad(c.mu) for c in rows]), mask=torch.cat([pad(c.mask) for c in rows]),
        spks=torch.cat([c.spks for c in rows]), cond=torch.cat([pad(c.cond) for c in rows]),
        streaming=torch.cat([c.streaming for c in rows]), finalize=torch.cat([c.finalize for c in rows]),
        enc_len=torch.cat([c.enc_len for c in rows]), mel_len=torch.cat([c.mel_len for c in rows]),
        prompt_feat_len=torch.cat([c.prompt_feat_len for c in rows]), out_len=torch.cat([c.out_len for c in rows]),
        max_out=max(c.max_out for c in rows))


def test_another_streams_cache_changes_the_mel(flow: DiTFlowModel, golden: dict) -> None:
    """The checks above can fail: a cache of the same length from a stream with other tokens (stale keys and
    values) moves the mel far beyond their tolerance."""
    prompt = voice(golden)
    ours, theirs = random_tokens(100, 3), random_tokens(100, 4)
    want = official_stream(flow, prompt, ours, [33, 83])
    stream, other = CachedStream(flow, prompt, ours), CachedStream(flow, prompt, theirs)
    stream.call(33)
    other.call(33)
    stream.cache = other.cache  # 100 frames, as its own would be
    assert float((stream.call(83) - want[1]).abs().max()) > 1e-2


def test_cache_size(flow: DiTFlowModel, golden: dict) -> None:
    """Per cached frame, step and guidance half: every layer's key and value; plus two 30-frame contexts."""
    stream = CachedStream(flow, voice(golden), random_tokens(60, 5))
    stream.call(33)
    c, steps = flow.config.estimator, flow.config.n_timesteps
    per_frame = steps * 2 * c.depth * 2 * c.heads * c.dim_head * 4
    contexts = steps * 2 * 2 * c.dim * 30 * 4
    assert stream.cache.frames == 100 and stream.cache.nbytes == 100 * per_frame + contexts


def test_a_voices_frames_seed_a_new_stream(flow: DiTFlowModel, golden: dict) -> None:
    """The prompt cache (models/prompt_cache.py) with the DiT: a 40-token prompt's first 37 tokens have their
    final mu, so its first 50-frame chunk is the voice's; a new stream of that voice starts after it."""
    rng = np.random.RandomState(9)
    prompt = FlowPrompt(speech_tokens=random_tokens(40, 8), mel=torch.from_numpy(rng.randn(1, 80, 80).astype(np.float32)),
                        embedding=torch.from_numpy(golden["in_embedding"]))
    assert voice_final_frames(flow, prompt, MAX_FRAMES) == 50
    voices = PromptCache.of_size_mb(64)
    first = CachedStream(flow, prompt, random_tokens(80, 10))
    first.cache = voices.open_stream(flow, prompt, MAX_FRAMES)
    c = conditions(flow, prompt, first.tokens[:, :35], final=False)
    _, _, _, (voice,) = cached_mel(flow, c, [first.cache], [int(c.mel_len[0])], MAX_FRAMES, [50])
    voices.store(first.cache.voice_key, voice)

    tokens, ends = random_tokens(90, 11), [35, 85]
    seeded = CachedStream(flow, prompt, tokens)
    seeded.cache = voices.open_stream(flow, prompt, MAX_FRAMES)
    assert seeded.cache.frames == 50 and voices.hits == 1
    assert max_error(seeded.run(ends), official_stream(flow, prompt, tokens, ends)) <= CACHED_ATOL
    assert seeded.computed[0] == 80 + 2 * (35 - 3) - 50


def test_cached_streaming_final_call(flow: DiTFlowModel, golden: dict) -> None:
    """With the final call streaming too (`FlowCacheSettings.cached_final`), it computes only the frames after
    the cache, and equals the uncached streaming final call."""
    prompt, tokens = voice(golden), random_tokens(100, 12)
    length = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    want = flow.inference(tokens, length(100), prompt.speech_tokens, length(prompt.speech_tokens.shape[1]), prompt.mel,
                          length(prompt.mel.shape[1]), prompt.embedding, streaming=True, finalize=True)
    stream = CachedStream(flow, prompt, tokens)
    stream.call(83)
    c = flow.conditions(tokens, length(100), prompt.speech_tokens, length(prompt.speech_tokens.shape[1]), prompt.mel,
                        length(prompt.mel.shape[1]), prompt.embedding, streaming=True, finalize=True)
    mel, (start,), (kept,), _ = cached_mel(flow, c, [stream.cache], [int(c.mel_len[0])], MAX_FRAMES)
    assert start == stream.cache.frames == 200 and kept is stream.cache  # the final call adds nothing
    got = mel[:, :, prompt.mel.shape[1] + 2 * 80 - start:int(c.mel_len[0]) - start]
    assert float((got - want[:, :, 2 * 80:]).abs().max()) <= CACHED_ATOL
