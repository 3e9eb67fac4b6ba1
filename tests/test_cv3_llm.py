"""CosyVoice3's speech LM in the serving paths: the in-flight batching scheduler and bistream input, on the tiny
CosyVoice3 golden folder.

The scheduler's greedy decode gives the official greedy tokens (the stop id that ends it comes before min_len:
the official torch loop masks SOS, not EOS, in CosyVoice3); a batch of sampled streams equals their solo runs
(`llm.generate`), with the LLM in fp32, bf16 and int8; a request without `<|endofprompt|>` is refused naming
the field; bistream input lays the prompt's head (up to `<|endofprompt|>`) right after sos, closes each group
with CosyVoice3's fill token, and the scheduler's bistream stream equals the reference `generate_bistream`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.family import COSYVOICE3, END_OF_PROMPT_ID
from cosyvoice_triton.llm.bistream import SOS, TASK_ID, BistreamPlan, Segment, generate_bistream
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.llm.scheduler import LLMScheduler, LLMStream
from cosyvoice_triton.messages import LLMRequest, SamplingParams
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.speech_lm import SpeechLM

GOLDEN = Path(__file__).resolve().parent / "golden" / "cv3" / "tiny"
MAX_SEQ_LEN = 256
GREEDY = SamplingParams(top_k=1, tau_r=1e6)  # the top token, never re-drawn for repeating itself

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN / "golden.npz") as data:
        return {key: data[key] for key in data.files}


def load_llm(precision: str = "fp32", max_batch: int = 4) -> SpeechLM:
    return family_models(GOLDEN / "model").load_llm(GOLDEN / "model", max_batch=max_batch, max_seq_len=MAX_SEQ_LEN,
                                                    precision=precision)


@pytest.fixture(scope="module")
def llm() -> SpeechLM:
    return load_llm()


def ids(golden: dict, key: str) -> list[int]:
    return golden[key].reshape(-1).tolist()


def request(golden: dict, stream_id: str, seed: int, sampling: SamplingParams = SamplingParams(),
            text_len: int | None = None, speech_len: int | None = None) -> LLMRequest:
    return LLMRequest(stream_id=stream_id, text_tokens=ids(golden, "in_text_token")[:text_len],
                      prompt_text_tokens=ids(golden, "in_prompt_text_token"),
                      prompt_speech_tokens=ids(golden, "in_prompt_speech_token")[:speech_len], sampling=sampling,
                      seed=seed)


def solo(llm: SpeechLM, req: LLMRequest) -> list[int]:
    """`generate` alone in slot 0, seeded as the scheduler seeds a stream."""
    as_ids = [torch.tensor([x], dtype=torch.int64).reshape(1, -1)
              for x in (req.text_tokens, req.prompt_text_tokens, req.prompt_speech_tokens)]
    return list(generate(llm, *as_ids, sampling=req.sampling, generator=torch.Generator().manual_seed(req.seed)))


def read_all(stream: LLMStream) -> list[int]:
    return [token for chunk in stream for token in chunk]


@pytest.fixture
def scheduler(llm: SpeechLM):
    made = LLMScheduler(llm, max_batch=4, max_seq_len=MAX_SEQ_LEN)
    made.start()
    yield made
    made.stop()


def test_the_scheduler_decodes_the_official_greedy_tokens_and_stops_before_min_len(
        scheduler: LLMScheduler, golden: dict) -> None:
    stream = scheduler.submit(request(golden, "greedy", seed=0, sampling=GREEDY))
    tokens = read_all(stream)
    assert tokens == golden["llm_greedy_tokens"].tolist()
    assert stream.reason == "stop_token" and len(tokens) < int(golden["llm_min_len"])  # SOS masked, not EOS


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_batched_streams_equal_their_solo_runs(golden: dict, precision: str) -> None:
    llm = load_llm(precision)
    requests = [request(golden, "zero-shot", seed=1), request(golden, "short", seed=2, text_len=5, speech_len=7),
                request(golden, "no-speech", seed=3, speech_len=0), request(golden, "greedy", seed=4, sampling=GREEDY)]
    expected = [solo(llm, req) for req in requests]
    scheduler = LLMScheduler(llm, max_batch=4, max_seq_len=MAX_SEQ_LEN)
    streams = [scheduler.submit(req) for req in requests]  # all admitted together: one batched decode
    scheduler.start()
    try:
        got = [read_all(stream) for stream in streams]
        assert scheduler.stats.peak_batch_size == 4
    finally:
        scheduler.stop()
    assert got == expected
    assert all(len(tokens) > 0 for tokens in got)


def test_a_request_without_end_of_prompt_is_refused_naming_the_field(scheduler: LLMScheduler, golden: dict) -> None:
    req = request(golden, "bad", seed=1)
    without = [t for t in req.prompt_text_tokens if t != END_OF_PROMPT_ID]
    with pytest.raises(InvalidInput) as raised:
        scheduler.submit(LLMRequest(**{**vars(req), "prompt_text_tokens": without}))
    assert raised.value.field == "prompt_text_tokens"
    with pytest.raises(InvalidInput, match="prompt_text_tokens"):
        scheduler.submit(LLMRequest(**{**vars(req), "prompt_text_tokens": without, "text_tokens": [1, 2],
                                       "bistream": True}))


def test_the_bistream_plan_feeds_the_head_after_sos_and_closes_groups_with_the_cosyvoice3_fill() -> None:
    speech = 6561
    fill = speech + COSYVOICE3.lm.fill
    head, transcript = [7, 8, END_OF_PROMPT_ID], [9, 10]
    plan = BistreamPlan(head + transcript, list(range(20)), speech, 20, fill_token=fill,
                        head_end_id=END_OF_PROMPT_ID)
    plan.add_text([11, 12, 13, 14, 15, 16, 17, 18])  # the transcript + 8: two groups of 5 lay out the prompt
    text = lambda *t: Segment("text", t)  # noqa: E731
    speech_ids = lambda *t: Segment("speech", t)  # noqa: E731
    assert plan.next_feed() == [SOS, text(*head), text(9, 10, 11, 12, 13), speech_ids(*range(15)),
                                text(14, 15, 16, 17, 18), speech_ids(*range(15, 20))]
    for _ in range(10):
        assert plan.accept(5) == "speech"
    assert plan.forced_token() == fill and plan.accept(fill) == "fill"

    # No prompt speech (cross_lingual, instruct2): the head waits for 5 text tokens, as sos alone does.
    plan = BistreamPlan(head, [], speech, 20, fill_token=fill, head_end_id=END_OF_PROMPT_ID)
    plan.add_text([1, 2, 3, 4])
    assert plan.next_feed() is None
    plan.add_text([5])
    assert plan.next_feed() == [SOS, text(*head), text(1, 2, 3, 4, 5)]
    plan.end_text()
    for _ in range(15):
        assert plan.accept(5) == "speech"
        plan.next_feed()
    assert plan.forced_token() == fill and plan.accept(fill) == "fill"
    assert plan.next_feed() == [TASK_ID]


def test_a_bistream_stream_equals_the_reference_however_the_text_is_cut(scheduler: LLMScheduler, llm: SpeechLM,
                                                                        golden: dict) -> None:
    text, prompt_text, prompt_speech = (ids(golden, k) for k in ("in_text_token", "in_prompt_text_token",
                                                                 "in_prompt_speech_token"))
    sampling = SamplingParams()
    expected = list(generate_bistream(llm, [text], prompt_text, prompt_speech, sampling,
                                      torch.Generator().manual_seed(11), slot=3))
    assert expected  # tokens come
    stream = scheduler.submit(LLMRequest("bistream", text[:4], prompt_text, prompt_speech, sampling, seed=11,
                                         bistream=True))
    stream.append_text(text[4:9])
    stream.append_text(text[9:], end=True)
    assert read_all(stream) == expected
