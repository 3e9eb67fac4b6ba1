"""Admitted streams are kept ahead: a free LLM slot goes to the sentence whose listener has the least
audio left, before new streams, and the lead travels from the pipeline to the `llm` model.

- the scheduler, one slot busy: a later sentence with 0.1 s of lead left is admitted before a new stream
  that came first, and before one with more lead; equal leads keep arrival order;
- `with_lead`: no lead before the listener has heard anything; afterwards the audio it has left;
- the `lead_s` tensor round-trips through the llm contract, and a negative one is refused naming it.
"""
from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.llm.scheduler import LLMScheduler
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.pipeline.pipeline import with_lead
from cosyvoice_triton.pipeline.playback import Playback
from cosyvoice_triton.random_folder.write import write_random_model
from cosyvoice_triton.wire.stage_tensors import llm_inputs, parse_llm_request
from cosyvoice_triton.wire.names import LEAD_S
from cosyvoice_triton.wire.tensors import TensorReader

from test_llm_scheduler import make_request

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> SpeechLM:
    model_dir = write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", backbone_weights=False)
    model = SpeechLM.from_model_dir(model_dir, max_batch=1, max_seq_len=512)
    model.config.max_token_text_ratio = 3.0
    return model


def test_a_free_slot_goes_to_the_least_lead_first(llm):
    scheduler = LLMScheduler(llm, max_batch=1, max_seq_len=512)
    scheduler.start()
    try:
        holder = scheduler.submit(make_request(llm, "holder", 6, seed=1))  # takes the one slot
        first_tokens = next(iter(holder))
        assert first_tokens
        order: list[str] = []
        lock = threading.Lock()
        # Submitted while the slot is taken, in this order: a new stream, a sentence with 1.5 s left, one
        # with 0.1 s left, another new stream.
        requests = [make_request(llm, "new-a", 2, seed=2), replace(make_request(llm, "lead-1.5", 2, seed=3), lead_s=1.5),
                    replace(make_request(llm, "lead-0.1", 2, seed=4), lead_s=0.1), make_request(llm, "new-b", 2, seed=5)]
        streams = [scheduler.submit(request) for request in requests]

        def read(stream):
            for _ in stream:
                with lock:
                    if stream.request.stream_id not in order:
                        order.append(stream.request.stream_id)

        readers = [threading.Thread(target=read, args=(stream,)) for stream in streams]
        for reader in readers:
            reader.start()
        for _ in holder:  # the holder runs to its end; then the slot goes round, one stream at a time
            pass
        for reader in readers:
            reader.join(timeout=60)
        assert order == ["lead-0.1", "lead-1.5", "new-a", "new-b"]
    finally:
        scheduler.stop()


def test_with_lead_is_the_audio_the_listener_has_left():
    request = make_request_stub()
    playback = Playback()
    assert with_lead(request, playback).lead_s is None  # nobody has heard anything yet
    import time

    playback.add(time.monotonic(), 5.0)
    lead = with_lead(request, playback).lead_s
    assert 4.0 < lead <= 5.0


def make_request_stub():
    from cosyvoice_triton.messages import LLMRequest, SamplingParams

    return LLMRequest(stream_id="s", text_tokens=[1], prompt_text_tokens=[], prompt_speech_tokens=[],
                      sampling=SamplingParams(), seed=1)


def test_lead_round_trips_through_the_llm_contract_and_a_negative_one_is_refused():
    from cosyvoice_triton.messages import SamplingParams

    request = replace(make_request_stub(), lead_s=0.75)
    parsed = parse_llm_request(TensorReader(llm_inputs(request)), SamplingParams())
    assert parsed.lead_s == pytest.approx(0.75)
    assert parse_llm_request(TensorReader(llm_inputs(make_request_stub())),
                                       SamplingParams()).lead_s is None
    values = {**llm_inputs(request), LEAD_S: np.array([-1.0], dtype=np.float32)}
    with pytest.raises(InvalidInput) as refused:
        parse_llm_request(TensorReader(values), SamplingParams())
    assert refused.value.field == LEAD_S
