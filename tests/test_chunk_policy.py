"""Chunk schedules: the fixed (official) one, and the adaptive one on fed lead values (no clock)."""
import pytest

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import ChunkPolicy
from cosyvoice_triton.pipeline.chunk_policy import LOW_LEAD_S, ChunkSchedule

LOOKAHEAD = 3
PROMPT = 20  # tokens: the first hop is padded by 5 to end on a 25-token flow chunk


def ends(policy: ChunkPolicy, leads: list[float | None], tokens: int = 2000) -> list[int]:
    """Chunk ends of a stream whose tokens all arrive at once, chunk k cut with the listener leads[k] ahead."""
    schedule = ChunkSchedule(policy, PROMPT)
    out = []
    for lead in leads:
        assert schedule.due(schedule.needed, lead)
        out.append(schedule.advance(schedule.needed, lead)[1])
    assert all(end <= tokens for end in out)
    return out


def hops(chunk_ends: list[int]) -> list[int]:
    starts = [0] + [end - LOOKAHEAD for end in chunk_ends[:-1]]
    return [end - LOOKAHEAD - start for start, end in zip(starts, chunk_ends)]


def test_fixed_is_the_official_schedule_whatever_the_lead():
    fixed = ChunkPolicy()
    assert hops(ends(fixed, [None] * 5)) == [30, 50, 100, 100, 100]
    assert ends(fixed, [0.0, -3.0, 0.1, 20.0, 0.0]) == ends(fixed, [None] * 5)
    assert ChunkSchedule(fixed, PROMPT).due(29 + LOOKAHEAD, lead_s=-5.0) is False  # never cut early


def test_adaptive_grows_while_the_listener_is_ahead():
    adaptive = ChunkPolicy(kind="adaptive")
    # after the first chunk (lead 0: its own 1.2 s cannot cover a 2 s hop) the hop stays 25; then, far
    # ahead, x2 at every chunk, past the fixed max_hop (100) up to 4 x 100
    assert hops(ends(adaptive, [0.0, 10.0, 10.0, 10.0, 20.0, 20.0, 20.0])) == [30, 25, 50, 100, 200, 400, 400]


def test_adaptive_grows_only_when_the_lead_covers_the_larger_hop():
    adaptive = ChunkPolicy(kind="adaptive")
    # first chunk: lead 0 + 1.2 s of audio < the 2 s of a 50-token hop: the second hop stays 25
    # second: 0.9 + 1.0 s < 2 s: stays; third: 1.0 + 1.0 >= 2: grows to 50; fourth: 1.0 + 2.0 < 4: stays
    assert hops(ends(adaptive, [0.0, 0.9, 1.0, 1.0, 1.0])) == [30, 25, 25, 50, 50]


def test_adaptive_shrinks_to_the_first_hop_when_the_lead_runs_low():
    adaptive = ChunkPolicy(kind="adaptive")
    low = LOW_LEAD_S / 2
    # 30, 25, 50, 100; then cut with 0.25 s left: back to 25; 1.5 s left + 1 s of audio covers 50 again
    assert hops(ends(adaptive, [0.0, 10.0, 10.0, low, 1.5, 1.5])) == [30, 25, 50, 100, 25, 50]


def test_adaptive_cuts_a_chunk_early_when_the_listener_runs_low():
    schedule = ChunkSchedule(ChunkPolicy(kind="adaptive"), PROMPT)
    assert schedule.advance(schedule.needed, 10.0) == (0, 33)  # 30 tokens, next hop 50 (lead 10 s)
    assert schedule.needed == 30 + 50 + LOOKAHEAD
    small = 30 + 25 + LOOKAHEAD  # a first_hop chunk's tokens
    assert not schedule.due(small - 1, lead_s=0.0)  # too few tokens even for a small chunk
    assert not schedule.due(small + 5, lead_s=2.0)  # enough lead: wait for the whole hop
    assert schedule.due(small + 5, lead_s=0.1)  # running low: go with what there is
    assert schedule.advance(small + 5, lead_s=0.1) == (30, small + 5)
    assert schedule.offset == small + 5 - LOOKAHEAD and schedule.hop == 25  # and the next hop is small


def test_the_first_chunk_is_never_cut_early():
    schedule = ChunkSchedule(ChunkPolicy(kind="adaptive", first_hop=4, align_to_chunk=False), PROMPT)
    assert schedule.needed == 4 + LOOKAHEAD and not schedule.due(6, lead_s=0.0)


def test_the_same_leads_give_the_same_boundaries():
    adaptive = ChunkPolicy(kind="adaptive", first_hop=8, hop_scale=1.5, max_hop=40, align_to_chunk=False)
    leads = [0.0, 0.2, 0.7, 1.9, 3.5, 0.1, 0.6, 2.0]
    assert ends(adaptive, leads) == ends(adaptive, list(leads))
    assert ends(adaptive, leads) != ends(ChunkPolicy(first_hop=8, hop_scale=1.5, max_hop=40,
                                                     align_to_chunk=False), leads)


def test_an_unknown_kind_is_refused_naming_the_field():
    with pytest.raises(InvalidInput, match="chunk_policy"):
        ChunkPolicy().with_overrides(kind="eager")
    assert ChunkPolicy().with_overrides(kind="adaptive").kind == "adaptive"


def test_the_in_process_pipeline_follows_the_request_policy(tiny_model_dir, prompt_wav_16k):
    """Same seed, same tokens: the same total audio, cut differently. An adaptive stream's first chunk
    leaves the listener 1.2 s at most, which cannot cover a 2 s hop: its second hop stays 25 tokens,
    where the fixed schedule doubles to 50 (whatever the clock says)."""
    from cosyvoice_triton.messages import SynthesisRequest
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2

    tts = CosyVoice2.from_model_dir(tiny_model_dir)
    samples, rate = prompt_wav_16k
    voice = tts.encode_voice(samples, rate, "今天天气真不错")

    def chunks(kind: str) -> list[int]:
        request = SynthesisRequest(text="你好，欢迎使用。", voice=voice, seed=7, chunk_policy=ChunkPolicy(kind=kind))
        return [chunk.size for chunk in tts.synthesize(request, stream=True)]

    fixed, adaptive = chunks("fixed"), chunks("adaptive")
    assert len(fixed) >= 3 and sum(fixed) == sum(adaptive)
    assert adaptive[0] == fixed[0] and adaptive[1] * 2 == fixed[1]


def test_the_gateway_and_the_sdk_carry_the_policy():
    """The gateway checks `chunk_policy` as the model will (its error names the field) and sends it on;
    the SDKs put it in the request (None: not sent, the server's policy)."""
    from cosyvoice_triton.client.gateway_client import tts_body
    from cosyvoice_triton.client.triton_client import synthesis_request
    from cosyvoice_triton.errors import InvalidInput
    from cosyvoice_triton.gateway.config import Limits
    from cosyvoice_triton.gateway.route_requests import START_KEYS, TTS_KEYS, parse_tts

    request = parse_tts({"text": "Hi.", "chunk_policy": "adaptive"}, Limits())
    assert request.inputs.tensors()["chunk_policy"].tolist() == [b"adaptive"]
    with pytest.raises(InvalidInput, match="^chunk_policy: must be one of fixed, adaptive"):
        parse_tts({"text": "Hi.", "chunk_policy": "eager"}, Limits())

    assert "chunk_policy" in TTS_KEYS and "chunk_policy" in START_KEYS  # fields /v1/tts and the WebSocket take
    assert tts_body("Hi.", chunk_policy="adaptive")["chunk_policy"] == "adaptive"
    assert "chunk_policy" not in tts_body("Hi.")
    tensors = synthesis_request("Hi.", voice_id="v", chunk_policy="adaptive").tensors()
    assert tensors["chunk_policy"].tolist() == [b"adaptive"]
    assert "chunk_policy" not in synthesis_request("Hi.", voice_id="v", chunk_policy=None).tensors()
