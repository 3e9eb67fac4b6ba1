"""Bistream text input in the LLM: the 5:15 plan, the single-stream reference and the scheduler.

The scheduler's bistream stream gets its text appended while other streams decode beside it; its tokens
must equal `generate_bistream` for the same seed, however the text is cut into pieces.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosyvoice_triton.messages import LLMRequest, SamplingParams
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.random_folder.write import write_random_model
from cosyvoice_triton.llm.bistream import SOS, TASK_ID, BistreamPlan, Segment, generate_bistream
from cosyvoice_triton.llm.scheduler import LLMScheduler

pytestmark = pytest.mark.timeout(120)

MAX_SEQ_LEN = 512
SPEECH = 100  # speech_token_size of the plan tests: fill = 102


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> SpeechLM:
    model_dir = write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", backbone_weights=False)
    model = SpeechLM.from_model_dir(model_dir, max_batch=1, max_seq_len=MAX_SEQ_LEN)
    model.config.max_token_text_ratio = 4.0  # short streams
    return model


def text(*ids: int) -> Segment:
    return Segment("text", tuple(ids))


def speech(*ids: int) -> Segment:
    return Segment("speech", tuple(ids))


def test_the_plan_lays_out_the_prompt_5_15_then_decodes_15_speech_tokens_per_5_text_tokens() -> None:
    plan = BistreamPlan(prompt_text_tokens=[1, 2, 3], prompt_speech_tokens=list(range(20)),
                        speech_token_size=SPEECH, max_token_text_ratio=20)
    plan.add_text([4])
    assert plan.next_feed() is None  # 4 text tokens: the prompt speech waits for a fifth
    plan.add_text([5, 6, 7, 8, 9, 10])
    feed = plan.next_feed()  # read token by token: at 10 the prompt speech is used up, decoding starts
    assert feed == [SOS, text(1, 2, 3, 4, 5), speech(*range(15)), text(6, 7, 8, 9, 10), speech(15, 16, 17, 18, 19)]
    outputs = []
    while (forced := plan.forced_token()) is None:  # the prompt's last group had 5: 10 more, then the fill
        assert plan.accept(7) == "speech"
        outputs.append(7)
        assert plan.next_feed() == [speech(7)]
    assert forced == SPEECH + 2 and len(outputs) == 10
    assert plan.accept(forced) == "fill" and plan.next_feed() is None  # no text left: wait
    plan.add_text([11, 12, 13, 14, 15, 16])
    assert plan.next_feed() == [text(11, 12, 13, 14, 15)]
    for _ in range(3):
        assert plan.accept(8) == "speech"
    assert plan.accept(SPEECH + 2) == "fill"  # a sampled fill ends the group early
    plan.end_text()
    assert plan.next_feed() == [text(16), TASK_ID]  # the rest, the task id: decode until a stop token
    assert not plan.ban_eos and plan.forced_token() is None
    assert plan.accept(SPEECH) == "stop"
    assert plan.history.count(SPEECH + 2) == 2 and plan.speech_out == 13 and plan.max_len == 13 * 20


def test_a_short_text_keeps_the_prompt_speech_not_yet_laid_out_after_the_task_id() -> None:
    plan = BistreamPlan([1, 2], list(range(40)), SPEECH, 20)
    plan.add_text([3, 4, 5])
    plan.end_text()
    assert plan.next_feed() == [SOS, text(1, 2, 3, 4, 5), speech(*range(15)), TASK_ID, speech(*range(15, 40))]


def test_the_reference_gives_the_same_tokens_however_the_text_is_cut(llm: SpeechLM) -> None:
    vocab = llm.config.qwen.vocab_size
    rng = torch.Generator().manual_seed(7)
    tokens = torch.randint(vocab, (23,), generator=rng).tolist()
    prompt_text = torch.randint(vocab, (4,), generator=rng).tolist()
    prompt_speech = torch.randint(llm.config.speech_token_size, (31,), generator=rng).tolist()

    def run(pieces):
        return list(generate_bistream(llm, pieces, prompt_text, prompt_speech, SamplingParams(),
                                      torch.Generator().manual_seed(3)))

    whole = run([tokens])
    assert len(whole) > 15  # speech went on past the first text groups
    assert run([[t] for t in tokens]) == whole
    assert run([tokens[:2], tokens[2:11], [], tokens[11:]]) == whole
    assert run([tokens]) != run([tokens[:-1]])  # the text matters


def bistream_request(llm: SpeechLM, name: str, seed: int, first: list[int], prompt_text: list[int],
                     prompt_speech: list[int]) -> LLMRequest:
    return LLMRequest(stream_id=name, text_tokens=first, prompt_text_tokens=prompt_text,
                      prompt_speech_tokens=prompt_speech, sampling=SamplingParams(), seed=seed, bistream=True)


def test_a_scheduler_stream_fed_text_while_others_decode_equals_the_reference(llm: SpeechLM) -> None:
    vocab, speech_size = llm.config.qwen.vocab_size, llm.config.speech_token_size
    rng = torch.Generator().manual_seed(11)
    tokens = torch.randint(vocab, (21,), generator=rng).tolist()
    prompt_text = torch.randint(vocab, (3,), generator=rng).tolist()
    prompt_speech = torch.randint(speech_size, (17,), generator=rng).tolist()
    expected = list(generate_bistream(llm, [tokens], prompt_text, prompt_speech, SamplingParams(),
                                      torch.Generator().manual_seed(5)))
    scheduler = LLMScheduler(llm, max_batch=3, max_seq_len=MAX_SEQ_LEN)
    scheduler.start()
    try:
        other = scheduler.submit(LLMRequest(stream_id="sentence", text_tokens=tokens[:6], prompt_text_tokens=[],
                                            prompt_speech_tokens=[], sampling=SamplingParams(), seed=9))
        stream = scheduler.submit(bistream_request(llm, "bi", 5, tokens[:3], prompt_text, prompt_speech))
        received: list[int] = []
        at = 3
        while at < len(tokens):  # a piece of text after each piece of speech (or at once when none comes)
            stream.append_text(tokens[at:at + 4])
            at += 4
            if at >= 13:  # by now the prompt is laid out and speech flows
                received += stream.get(timeout=60) or []
        stream.append_text([], end=True)
        received += [t for piece in stream for t in piece]
        assert received == expected
        assert stream.reason in ("stop_token", "max_len")
        assert [t for piece in other for t in piece]  # the sentence stream beside it ran to its end
        assert scheduler.stats.slots_free == 3
    finally:
        scheduler.stop()
