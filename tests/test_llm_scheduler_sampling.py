"""The scheduler's batched draw: a row whose draw fails fails only its stream, in the same round as others."""
from __future__ import annotations

import math

import pytest
from torch import Tensor

from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.llm.scheduler import LLMScheduler, LLMStepError
import test_llm_scheduler as base
from test_llm_scheduler import make_request, read_all, solo

pytestmark = pytest.mark.timeout(120)
model_dir, llm, schedulers = base.model_dir, base.llm, base.schedulers  # the scheduler tests' fixtures


def test_a_row_without_a_distribution_fails_only_its_stream(llm: SpeechLM, schedulers: list[LLMScheduler]) -> None:
    bad, good = make_request(llm, "bad", 3, 2, 5, seed=21), make_request(llm, "good", 2, 1, 4, seed=22)
    expected_bad, expected_good = solo(llm, bad), solo(llm, good)
    scheduler = LLMScheduler(llm, max_batch=2)
    schedulers.append(scheduler)
    inner = llm.step_logits

    def nan_in_slot_0(x: Tensor, input_pos: Tensor, slots: Tensor, kv_len: int | None = None) -> Tensor:
        logits = inner(x, input_pos, slots, kv_len)  # (B, V)
        if x.shape[:2] == (2, 1):  # the decode steps of both streams: the bad one (slot 0) gets NaN
            logits[slots == 0] = math.nan
        return logits

    llm.step_logits = nan_in_slot_0  # the instance attribute shadows the method
    streams = [scheduler.submit(bad), scheduler.submit(good)]  # before start: bad takes slot 0
    scheduler.start()
    with pytest.raises(LLMStepError, match="sampling failed for request bad"):
        read_all(streams[0])
    assert streams[0].reason == "error"
    assert read_all(streams[1]) == expected_good
    assert scheduler.stats.peak_batch_size == 2 and scheduler.stats.slots_free == 2
    assert len(expected_bad) > 1  # the bad stream was still decoding when its row went NaN
