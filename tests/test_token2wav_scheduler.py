"""Token2WavScheduler: many streams batched through one flow call; each stream equals its solo Token2WavStream.

Six streams with different prompts (slices of the golden prompt and random ones), token sequences, seeds and
chunk schedules are cut into chunks exactly where the solo reference emitted audio; `run` calls then mix
chunks of several streams, first and final chunks together, with bad chunks alongside the good ones.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from cosyvoice_triton.errors import InvalidInput, NotFound, Unavailable
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import GeneratorNoise
from cosyvoice_triton.messages import ChunkPolicy
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule
from cosyvoice_triton.token2wav.stream import FlowPrompt, Token2Wav
from cosyvoice_triton.token2wav.scheduler import ChunkRequest, Token2WavScheduler

WAVE_TOL = 1e-3


@dataclass(frozen=True)
class Voice:
    stream_id: str
    prompt: FlowPrompt
    tokens: list[int]
    policy: ChunkPolicy
    seed: int
    streaming: bool = True


@dataclass(frozen=True)
class Reference:
    """The solo run of a voice, and the scheduler's chunks cut at the same token boundaries."""

    audio: list[np.ndarray]  # one array per chunk
    chunks: list[ChunkRequest]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def golden_prompt(golden: dict, start: int, stop: int, embedding_scale: float) -> FlowPrompt:
    """Tokens [start, stop) of the golden prompt with their mel frames (2 per token)."""
    return FlowPrompt(speech_tokens=torch.from_numpy(golden["in_prompt_speech_token"][:, start:stop]),
                      mel=torch.from_numpy(golden["in_prompt_feat"][:, 2 * start:2 * stop]),
                      embedding=torch.from_numpy(golden["in_embedding"]) * embedding_scale)


def random_prompt(golden: dict, rng: np.random.RandomState, tokens: int) -> FlowPrompt:
    """Random tokens; mel frames drawn from the golden prompt's, perturbed; a random speaker."""
    feat = golden["in_prompt_feat"][0]
    mel = feat[rng.randint(0, feat.shape[0], size=2 * tokens)] + 0.1 * rng.randn(2 * tokens, feat.shape[1])
    return FlowPrompt(speech_tokens=torch.from_numpy(rng.randint(0, 6561, size=(1, tokens)).astype(np.int32)),
                      mel=torch.from_numpy(mel[None].astype(np.float32)),
                      embedding=torch.from_numpy(rng.randn(1, 192).astype(np.float32)))


@pytest.fixture(scope="module")
def voices(golden: dict) -> dict[str, Voice]:
    rng = np.random.RandomState(5)
    golden_tokens = golden["flow_token"][0].tolist()  # 90 tokens
    random_tokens = lambda n: rng.randint(0, 6561, size=n).tolist()  # noqa: E731
    voices = [
        Voice("s0", golden_prompt(golden, 0, 20, 1.0), golden_tokens, ChunkPolicy(), seed=11),
        Voice("s1", golden_prompt(golden, 5, 20, 0.5), golden_tokens[10:70],
              ChunkPolicy(first_hop=8, align_to_chunk=False), seed=12),
        Voice("s2", random_prompt(golden, rng, 12), random_tokens(70),
              ChunkPolicy(first_hop=10, hop_scale=1.0, align_to_chunk=False), seed=13),
        Voice("s3", random_prompt(golden, rng, 30), random_tokens(40),
              ChunkPolicy(first_hop=4, hop_scale=3.0, max_hop=20, align_to_chunk=False), seed=14),
        Voice("s4", golden_prompt(golden, 0, 8, 2.0), golden_tokens[::-1][:50], ChunkPolicy(), seed=15,
              streaming=False),
        Voice("cancelled", random_prompt(golden, rng, 16), random_tokens(60),
              ChunkPolicy(first_hop=6, align_to_chunk=False), seed=16),
    ]
    return {voice.stream_id: voice for voice in voices}


def solo(token2wav: Token2Wav, voice: Voice) -> Reference:
    """Cut the tokens where the voice's chunk schedule says, and run the chunks through Token2WavStream."""
    schedule = ChunkSchedule(voice.policy, voice.prompt.speech_tokens.shape[1])
    ends = [0]
    while voice.streaming and schedule.needed <= len(voice.tokens):
        ends.append(schedule.advance()[1])
    ends.append(len(voice.tokens))
    spans = list(zip(ends[:-1], ends[1:]))
    chunks = [ChunkRequest(voice.stream_id, voice.tokens[start:end], finalize=j == len(spans) - 1,
                           prompt=voice.prompt if j == 0 else None, seed=voice.seed)
              for j, (start, end) in enumerate(spans)]
    stream = token2wav.stream(voice.prompt, GeneratorNoise.seeded(voice.seed))
    return Reference([stream.chunk(chunk.tokens, chunk.finalize) for chunk in chunks], chunks)


@pytest.fixture(scope="module")
def references(flow: FlowModel, hift: HiFTGenerator, voices: dict[str, Voice]) -> dict[str, Reference]:
    token2wav = Token2Wav(flow, hift)
    return {stream_id: solo(token2wav, voice) for stream_id, voice in voices.items()}


def assert_audio_equal(got: list, expected: list[np.ndarray]) -> float:
    """Chunk by chunk; returns the max abs difference."""
    assert len(got) == len(expected)
    worst = 0.0
    for chunk, reference in zip(got, expected):
        assert isinstance(chunk, np.ndarray), chunk
        assert chunk.dtype == np.float32 and chunk.shape == reference.shape
        worst = max(worst, float(np.abs(chunk - reference).max(initial=0.0)))
    assert worst <= WAVE_TOL
    return worst


def test_mixed_streams_equal_solo_runs(flow, hift, voices, references, monkeypatch):
    """Chunks of six streams interleaved over run calls, bad chunks among them, one stream cancelled."""
    refs = references
    vocoder_batches: list[int] = []
    vocode = hift.inference

    def spy(mel, cache_source, noise):
        vocoder_batches.append(mel.shape[0])
        return vocode(mel, cache_source, noise)

    monkeypatch.setattr(hift, "inference", spy)
    assert [len(refs[s].chunks) for s in ("s0", "s1", "s2", "s3", "s4")] == [3, 4, 7, 4, 1]
    other_prompt = voices["s3"].prompt
    too_short = ChunkRequest("s0", [5], finalize=False, prompt=None, seed=None)  # advances the offset by 1
    bad_prompt = replace(voices["s1"].prompt, mel=voices["s1"].prompt.mel[:, 1:])
    calls: list[list[ChunkRequest]] = [
        [refs["s0"].chunks[0], refs["s1"].chunks[0], refs["cancelled"].chunks[0]],
        [ChunkRequest("ghost", [1, 2, 3, 4, 5, 6, 7, 8], finalize=False, prompt=None, seed=None),
         too_short, refs["s0"].chunks[1],
         ChunkRequest("s1", [6561] * 8, finalize=False, prompt=None, seed=None),
         refs["s1"].chunks[1], refs["s1"].chunks[2],  # two chunks of one stream: in order
         ChunkRequest("bad", [1] * 8, finalize=False, prompt=bad_prompt, seed=1),
         refs["s2"].chunks[0], refs["cancelled"].chunks[1]],
        [refs["s3"].chunks[0], refs["s0"].chunks[2], replace(refs["s2"].chunks[1], prompt=other_prompt),
         refs["s1"].chunks[3]],
        [refs["s4"].chunks[0], refs["s2"].chunks[2], refs["s3"].chunks[1], refs["cancelled"].chunks[2]],
        [refs["s3"].chunks[2], refs["s2"].chunks[3]],
        [refs["s2"].chunks[4], refs["s3"].chunks[3]],
        [refs["s2"].chunks[5]],
        [refs["s2"].chunks[6]],
    ]
    expected_errors = {(1, 0): (NotFound, "stream_id"), (1, 1): (InvalidInput, "tokens"),
                       (1, 3): (InvalidInput, "tokens"), (1, 6): (InvalidInput, "prompt.mel"),
                       (3, 3): (NotFound, "stream_id")}
    scheduler = Token2WavScheduler(flow, hift)
    audio: dict[str, list[np.ndarray]] = {stream_id: [] for stream_id in voices}
    for c, call in enumerate(calls):
        if c == 3:
            assert scheduler.cancel("cancelled") and not scheduler.cancel("cancelled")
        results = scheduler.run(call)
        assert len(results) == len(call)
        for k, (chunk, result) in enumerate(zip(call, results)):
            if (c, k) in expected_errors:
                error_type, field = expected_errors[(c, k)]
                assert isinstance(result, error_type) and result.field == field, result
            else:
                audio[chunk.stream_id].append(result)

    worst = max(assert_audio_equal(audio[s], refs[s].audio) for s in ("s0", "s1", "s2", "s3", "s4"))
    assert_audio_equal(audio["cancelled"], refs["cancelled"].audio[:2])
    print(f"max abs difference to the solo references: {worst:.2e}")
    stats = scheduler.stats
    assert stats.max_flow_batch > 1 and stats.mean_flow_batch > 1
    assert vocoder_batches and max(vocoder_batches) == 1  # one row a HiFT call: a batch would round otherwise
    assert stats.flow_calls < sum(len(r.chunks) for r in refs.values())
    assert stats.active_streams == 0
    assert stats.freed == {"finalize": 5, "cancel": 1, "idle": 0}
    assert stats.chunks_failed == len(expected_errors)
    assert stats.chunks_served == sum(len(a) for a in audio.values())
    assert isinstance(scheduler.run([refs["s0"].chunks[1]])[0], NotFound)  # gone after its final chunk


def test_first_chunks_go_first(flow, hift, references, monkeypatch):
    """max_batch 2: three first chunks and two later ones in one call take three flow batches. The clock
    stands still, so s1 and s2 are still ahead of their listeners (their deadlines lie after now)."""
    refs = references
    scheduler = Token2WavScheduler(flow, hift, max_batch=2, clock=FakeClock())
    assert all(isinstance(r, np.ndarray) for r in scheduler.run([refs["s1"].chunks[0], refs["s2"].chunks[0]]))
    batches: list[list[int]] = []  # prompt lengths of each flow call's rows; they tell the streams apart
    conditions = flow.conditions  # the encoder step of every flow call (the flow cache is on by default)

    def spy(**inputs):
        batches.append(inputs["prompt_token_len"].tolist())
        return conditions(**inputs)

    monkeypatch.setattr(flow, "conditions", spy)
    order = [("s1", 1), ("s2", 1), ("s0", 0), ("s3", 0), ("cancelled", 0)]  # (stream, chunk index)
    results = scheduler.run([refs[stream_id].chunks[j] for stream_id, j in order])
    assert batches == [[20, 30], [16, 15], [12]]  # s0, s3 (first) | cancelled (first), s1 | s2
    for (stream_id, j), result in zip(order, results):
        assert_audio_equal([result], [refs[stream_id].audio[j]])
    assert scheduler.stats.last_flow_batch == 1 and scheduler.stats.active_streams == 5


def test_chunks_go_by_deadline(flow, hift, references, monkeypatch):
    """max_batch 1: a stream whose listener ran dry goes before a new stream (deadline now), which goes
    before a stream that is still ahead; streams with equal deadlines keep their input order."""
    refs, clock = references, FakeClock()
    scheduler = Token2WavScheduler(flow, hift, max_batch=1, clock=clock)
    scheduler.run([refs["s1"].chunks[0]])
    clock.now = 10.0
    scheduler.run([refs["s2"].chunks[0]])
    audio_s = {sid: refs[sid].audio[0].size / hift.config.sampling_rate for sid in ("s1", "s2")}
    assert scheduler.deadline("s1", clock.now) == pytest.approx(0.0 + audio_s["s1"])  # first audio + audio made
    assert scheduler.deadline("s2", clock.now) == pytest.approx(10.0 + audio_s["s2"])
    assert scheduler.deadline("new", clock.now) == clock.now
    clock.now = 10.0 + audio_s["s2"] / 2  # s1 ran dry long ago; s2 is still ahead
    prompt_lengths: list[int] = []
    conditions = flow.conditions  # the encoder step of every flow call (the flow cache is on by default)

    def spy(**inputs):
        prompt_lengths.extend(inputs["prompt_token_len"].tolist())
        return conditions(**inputs)

    monkeypatch.setattr(flow, "conditions", spy)
    order = [("s2", 1), ("s3", 0), ("s1", 1), ("s0", 0)]  # input order: ahead, new, dry, new
    results = scheduler.run([refs[stream_id].chunks[j] for stream_id, j in order])
    assert prompt_lengths == [15, 30, 20, 12]  # s1 (dry) | s3, s0 (new, in input order) | s2 (ahead)
    for (stream_id, j), result in zip(order, results):
        assert_audio_equal([result], [refs[stream_id].audio[j]])
    # s1's second chunk moved its deadline on by that chunk's audio
    later = refs["s1"].audio[1].size / hift.config.sampling_rate
    assert scheduler.deadline("s1", clock.now) == pytest.approx(audio_s["s1"] + later)


def test_idle_streams_are_swept(flow, hift, references):
    """A stream that gets chunks and is then abandoned (its frontend died without cancelling) is freed once
    idle_timeout_s passed since its latest chunk was answered, by sweep_idle or by the next run."""
    refs, clock = references, FakeClock()
    scheduler = Token2WavScheduler(flow, hift, idle_timeout_s=120.0, clock=clock)
    scheduler.run([refs["s0"].chunks[0], refs["s1"].chunks[0]])
    clock.now = 100.0
    assert isinstance(scheduler.run([refs["s0"].chunks[1]])[0], np.ndarray)
    clock.now = 130.0  # s1 idle for 130 s, s0 for 30 s
    assert scheduler.sweep_idle() == ["s1"]
    assert isinstance(scheduler.run([refs["s1"].chunks[1]])[0], NotFound)
    clock.now = 250.5  # s0 idle for 150.5 s: another stream's run sweeps it before serving
    scheduler.run([refs["s2"].chunks[0]])
    assert scheduler.stats.freed["idle"] == 2
    result = scheduler.run([refs["s0"].chunks[2]])[0]
    assert isinstance(result, NotFound) and "s0" in str(result)
    assert scheduler.stats.active_streams == 1  # s2


def slow_flow(flow: FlowModel, clock: FakeClock, seconds: float, monkeypatch) -> None:
    """Every flow call takes `seconds` on the clock (an overloaded machine)."""
    conditions = flow.conditions

    def slow(**inputs):
        clock.now += seconds
        return conditions(**inputs)

    monkeypatch.setattr(flow, "conditions", slow)


def test_a_stream_waiting_behind_other_streams_chunks_is_not_freed(flow, hift, references, monkeypatch):
    """Each flow call takes 200 s, more than the 120 s timeout: s0's clock starts when its chunk is answered
    and stands still while s1's batch runs (s0's next chunk would wait behind it), so neither the sweeper
    between two batches nor the next run frees it. Once nothing runs, the abandoned s1 is freed."""
    refs, clock = references, FakeClock()
    scheduler = Token2WavScheduler(flow, hift, idle_timeout_s=120.0, clock=clock)
    slow_flow(flow, clock, 200.0, monkeypatch)
    assert isinstance(scheduler.run([refs["s0"].chunks[0]])[0], np.ndarray)  # came at 0, answered at 200
    assert isinstance(scheduler.run([refs["s1"].chunks[0]])[0], np.ndarray)  # 200 to 400: s0 waits
    clock.now += 100.0  # nothing runs for 100 s
    assert scheduler.sweep_idle() == []
    assert isinstance(scheduler.run([refs["s0"].chunks[1]])[0], np.ndarray)  # s1 left: quiet for 100 s
    clock.now += 30.0  # s1 quiet for 130 s, s0 for 30 s
    assert scheduler.sweep_idle() == ["s1"]
    assert scheduler.stats.active_streams == 1 and scheduler.stats.freed["idle"] == 1


def test_a_stream_with_a_chunk_in_hand_is_not_freed(flow, hift, references):
    """A chunk that comes after a quiet time longer than the timeout (an LLM slower than it) finds its stream:
    the run that serves it does not sweep it. Abandoned after that chunk, the stream is freed after the timeout."""
    refs, clock = references, FakeClock()
    scheduler = Token2WavScheduler(flow, hift, idle_timeout_s=120.0, clock=clock)
    scheduler.run([refs["s0"].chunks[0]])
    clock.now = 500.0  # no sweep ran meanwhile
    assert isinstance(scheduler.run([refs["s0"].chunks[1]])[0], np.ndarray)
    clock.now = 619.0
    assert scheduler.sweep_idle() == []
    clock.now = 621.0
    assert scheduler.sweep_idle() == ["s0"] and scheduler.stats.active_streams == 0


def test_stream_limit(flow, hift, voices, references):
    refs = references
    scheduler = Token2WavScheduler(flow, hift, max_streams=2)
    first_chunks = [refs[s].chunks[0] for s in ("s1", "s2", "s3")]
    ok_1, ok_2, refused = scheduler.run(first_chunks)
    assert isinstance(ok_1, np.ndarray) and isinstance(ok_2, np.ndarray)
    assert isinstance(refused, Unavailable) and "max_streams=2" in str(refused)
    # A stream that ends frees its slot; one without tokens at all gives empty audio.
    scheduler.cancel("s2")
    empty = ChunkRequest("empty", [], finalize=True, prompt=voices["s0"].prompt, seed=None)
    assert scheduler.run([empty])[0].shape == (0,)
    assert isinstance(scheduler.run([refs["s3"].chunks[0]])[0], np.ndarray)
    assert scheduler.stats.active_streams == 2


def test_lookahead_below_the_flow_is_refused(flow, hift):
    with pytest.raises(ValueError, match="lookahead"):
        Token2WavScheduler(flow, hift, lookahead=flow.config.pre_lookahead_len - 1)
