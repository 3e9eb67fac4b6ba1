"""Speech marks (pipeline/speech_marks.py, docs/api/speech-marks.md): sentence, <mark> and
<break> times in the output audio and spans in the request text, on every route.

Library: spans of plain text and SSML, marks that tile the audio, before the audio they describe, audio unchanged.
Routes (a real tritonserver + the gateway, tiny random model): Triton gRPC (streamed and offline), the SDKs,
WebSocket, /v1/tts as JSON and as server-sent events, OpenAI SSE, the CLI: the same marks for the same request
and seed, each mark's start_ms equal to the audio received before it.
"""
from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import numpy as np
import pytest

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import SAMPLE_RATE, SynthesisRequest
from cosyvoice_triton.pipeline.speech_marks import (MarkEnd, MarkList, SpeechMark, complete_marks, ms, samples_of,
                                                    shifted)
from cosyvoice_triton.preprocess.spans import source_spans

SEED = 11
# two sentences for the text preprocessor (the first over 60 tokens), with text that normalization changes
TEXT = ("Hello there, and welcome to the 2 o'clock tour of the old town, which takes about an hour and a half "
        "and then ends down at the old river bank by the mill. Tickets are $5 each (cash only). Enjoy the walk! ")
SSML = ('<speak>Hello there. <mark name="here"/>How are you?<break time="250ms"/>'
        '<s><emphasis>Fine</emphasis> &amp; well.</s></speak>')
TIMEOUT = aiohttp.ClientTimeout(total=300)


# ---- pure functions -------------------------------------------------------------------------------------------

def test_source_spans_map_normalized_sentences_back_to_the_input():
    text = "Hello there. I have 12 apples! (Really?) Yes.  "
    pieces = ["Hello there.", " I have twelve apples!", " Really?", " Yes."]
    spans = source_spans(text, pieces)
    assert [text[a:b] for a, b in spans] == ["Hello there.", "I have 12 apples!", "(Really?)", "Yes."]
    zh = "今天是2024年1月5日。天气很好！"
    assert [zh[a:b] for a, b in source_spans(zh, ["今天是二零二四年一月五日。", "天气很好！"])] == \
        ["今天是2024年1月5日。", "天气很好！"]
    assert source_spans("  one piece  ", ["one piece."]) == [(2, 11)]


def test_ms_round_trips_samples_and_shift_moves_an_event():
    for samples in (0, 1, 23, 24, 480, 12345, 10 * SAMPLE_RATE + 7):
        assert samples_of(ms(samples)) == samples
    event = SpeechMark(1, "sentence", 480, None, (3, 9), "Hi.").to_json()
    assert event == {"type": "sentence", "index": 1, "start_ms": 20.0, "end_ms": None, "start": 3, "end": 9,
                     "value": "Hi."}
    assert shifted(event, 24000, 100, 5) == {**event, "index": 6, "start_ms": 1020.0, "start": 103, "end": 109}
    end = MarkEnd(1, 960).to_json()
    assert end == {"type": "mark_end", "index": 1, "end_ms": 40.0}
    assert shifted(end, 24, 7, 2) == {"type": "mark_end", "index": 3, "end_ms": 41.0}
    assert complete_marks([event, end]) == [{**event, "end_ms": 40.0}]
    assert MarkList().extend(complete_marks([event, end])).marks == complete_marks([event, end])


# ---- the in-process pipeline ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tts(tiny_model_dir):
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2

    tts = CosyVoice2.from_model_dir(tiny_model_dir)
    tts.llm.config.max_token_text_ratio = 3.0  # the random LLM rarely stops on its own: short sentences
    return tts


@pytest.fixture(scope="module")
def voice(tts, prompt_wav_16k):
    samples, rate = prompt_wav_16k
    return tts.encode_voice(samples, rate, "a prompt transcript")


def run(tts, voice, text: str, stream: bool, **fields) -> list:
    return list(tts.synthesize(SynthesisRequest(text=text, voice=voice, seed=SEED, **fields), stream=stream))


def split(items: list) -> tuple[np.ndarray, list[dict]]:
    """(the audio, the mark events as JSON) of a pipeline's items; checks each mark's start against the audio
    yielded before it."""
    samples, events = 0, []
    for item in items:
        if isinstance(item, np.ndarray):
            samples += item.size
        else:
            event = item.to_json()
            if "start_ms" in event:
                assert samples_of(event["start_ms"]) == samples, event
            else:
                assert samples_of(event["end_ms"]) == samples, event
            events.append(event)
    audio = [i for i in items if isinstance(i, np.ndarray)]
    return (np.concatenate(audio) if audio else np.zeros(0, np.float32)), events


def check_tiling(marks: list[dict], audio_samples: int) -> None:
    """Sentences and breaks follow each other without gap or overlap from 0 to the audio's end; marks are points."""
    at = 0
    for mark in marks:
        assert mark["index"] == marks.index(mark)
        if mark["type"] == "mark":
            assert mark["start_ms"] == mark["end_ms"] == ms(at)
            continue
        assert mark["start_ms"] == ms(at) and mark["end_ms"] >= mark["start_ms"], mark
        at = samples_of(mark["end_ms"])
    assert at == audio_samples
    durations = sum(samples_of(m["end_ms"]) - samples_of(m["start_ms"]) for m in marks)
    assert durations == audio_samples


def test_plain_text_marks_tile_the_audio_and_change_nothing(tts, voice):
    plain = run(tts, voice, TEXT, True)
    assert all(isinstance(item, np.ndarray) for item in plain)  # marks off: only audio, as before
    audio, events = split(run(tts, voice, TEXT, True, marks=True))
    np.testing.assert_array_equal(audio, np.concatenate(plain))
    marks = complete_marks(events)
    assert [m["value"] for m in marks] == [
        "Hello there, and welcome to the 2 o'clock tour of the old town, which takes about an hour and a half and "
        "then ends down at the old river bank by the mill.", "Tickets are $5 each (cash only). Enjoy the walk!"]
    assert [m["value"] for m in marks] == [TEXT[m["start"]:m["end"]] for m in marks]
    check_tiling(marks, audio.size)
    assert all(e["end_ms"] is None for e in events if e["type"] == "sentence")  # its end follows its audio


@pytest.mark.parametrize("stream", [False, True])
def test_ssml_marks_breaks_and_spans(tts, voice, stream):
    plain = run(tts, voice, SSML, stream)
    audio, events = split(run(tts, voice, SSML, stream, marks=True))
    np.testing.assert_array_equal(audio, np.concatenate(plain))
    marks = complete_marks(events)
    assert [(m["type"], m["value"]) for m in marks] == [
        ("sentence", "Hello there."), ("mark", "here"), ("sentence", "How are you?"), ("break", "250ms"),
        ("sentence", "Fine & well.")]
    check_tiling(marks, audio.size)
    assert [SSML[m["start"]:m["end"]] for m in marks] == [
        "Hello there.", '<mark name="here"/>', "How are you?", '<break time="250ms"/>',
        "<emphasis>Fine</emphasis> &amp; well."]
    brk = marks[3]
    assert samples_of(brk["end_ms"]) - samples_of(brk["start_ms"]) == SAMPLE_RATE // 4


def test_marks_need_sentences():
    from cosyvoice_triton.wire.requests import SynthesisInputs

    with pytest.raises(InvalidInput) as error:
        SynthesisInputs(text="", text_mode="bistream", text_stream_id="s", marks=True).check(100)
    assert error.value.field == "speech_marks"
    assert SynthesisInputs(text="Hi.", marks=True).tensors()["speech_marks"].tolist() == [True]
    assert "speech_marks" not in SynthesisInputs(text="Hi.").tensors()


# ---- every route: a real tritonserver + the gateway ----------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    from web.stack import serve_stack

    with serve_stack(tmp_path_factory.mktemp("marks"), tiny_model_dir) as stack:
        yield stack


class Received:
    """What a streamed route delivered, in order: each mark event checked against the audio received before it
    (a mark's start_ms, a mark_end's end_ms)."""

    def __init__(self):
        self.samples = 0
        self.events: list[dict] = []
        self.audio: list[np.ndarray] = []

    def event(self, event: dict) -> None:
        at = event["end_ms"] if event["type"] == "mark_end" else event["start_ms"]
        assert samples_of(at) == self.samples, (event, self.samples)
        self.events.append(event)

    def chunk(self, chunk: np.ndarray) -> None:
        self.audio.append(np.asarray(chunk, dtype=np.float32))
        self.samples += chunk.size

    def close(self, complete: list[dict]) -> None:
        """The stream's complete marks: a mark_end that came after the last chunk (with none after it to carry
        it) ends at the end of the audio."""
        for mark in self.marks:
            if mark["end_ms"] is None:
                self.event({"type": "mark_end", "index": mark["index"],
                            "end_ms": complete[mark["index"]]["end_ms"]})
        assert self.marks == complete

    @property
    def marks(self) -> list[dict]:
        return complete_marks(self.events)

    @property
    def waveform(self) -> np.ndarray:
        return np.concatenate(self.audio)


@pytest.fixture(scope="module")
def reference(stack):
    """The document over Triton gRPC (the SDK, streamed): its audio without marks, and with them."""
    from cosyvoice_triton.client import TritonTTS

    with TritonTTS(stack.triton.grpc_url) as tts:
        plain = tts.synthesize(SSML, voice_id="default", seed=SEED)
        received = Received()
        with tts.stream(SSML, voice_id="default", seed=SEED, marks=True) as chunks:
            for chunk in chunks:
                for event in chunk.marks:
                    received.event(event)
                received.chunk(chunk)
        received.close(chunks.marks)  # the last mark_end came alone, after the audio
        offline = tts.synthesize(SSML, voice_id="default", seed=SEED, offline=True, marks=True)
    assert not hasattr(plain, "marks") or plain.marks == []
    return plain, received, offline


def test_triton_grpc_marks_tile_the_audio_and_leave_it_unchanged(reference):
    plain, received, offline = reference
    np.testing.assert_array_equal(received.waveform, plain)
    check_tiling(received.marks, plain.size)
    assert [(m["type"], m["value"]) for m in received.marks] == [
        ("sentence", "Hello there."), ("mark", "here"), ("sentence", "How are you?"), ("break", "250ms"),
        ("sentence", "Fine & well.")]
    assert offline.marks == received.marks  # the offline twin: the same sample counts, so the same marks
    check_tiling(offline.marks, offline.size)


def post(stack, path: str, body: dict) -> tuple[int, bytes, str]:
    async def send():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(stack.gateway_url + path, json=body) as response:
                return response.status, await response.read(), response.headers.get("Content-Type", "")

    return asyncio.run(send())


def sse_received(raw: bytes, sample_bytes: int, dtype: str) -> tuple[Received, dict]:
    """The server-sent events of an answer: (what they delivered, the done event)."""
    from cosyvoice_triton.pipeline.speech_marks import event_of

    received, done, rest = Received(), None, b""
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        data = json.loads(line[6:])
        if data["type"] == "speech.audio.delta":
            rest += base64.b64decode(data["audio"])
            cut = len(rest) // sample_bytes * sample_bytes
            received.chunk(np.frombuffer(rest[:cut], dtype).astype(np.float32))
            rest = rest[cut:]
        elif (event := event_of(data, "speech.")) is not None:
            received.event(event)
        else:
            assert data["type"] == "speech.audio.done", data
            done = data
    return received, done


def test_tts_json_answer_and_stream_carry_the_same_marks(stack, reference):
    plain, received, offline = reference
    body = {"text": SSML, "voice_id": "default", "seed": SEED, "format": "pcm_f32"}
    status, raw, kind = post(stack, "/v1/tts", {**body, "marks": True})
    assert status == 200 and kind.startswith("application/json"), raw[:300]
    answer = json.loads(raw)
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(answer["audio"]), "<f4"), offline)
    assert answer["marks"] == received.marks and answer["sample_rate"] == SAMPLE_RATE
    status, raw, kind = post(stack, "/v1/tts", {**body, "marks": True, "stream": True})
    assert status == 200 and kind.startswith("text/event-stream")
    streamed, done = sse_received(raw, 4, "<f4")
    np.testing.assert_array_equal(streamed.waveform, plain)
    assert streamed.marks == received.marks == done["marks"]
    status, raw, _ = post(stack, "/v1/tts", {**body, "stream": True})  # marks off: the audio bytes as before
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4"), plain)


def test_openai_sse_marks(stack, reference):
    plain, received, _ = reference
    body = {"model": "cosyvoice2", "input": SSML, "voice": "default", "seed": SEED, "response_format": "pcm",
            "stream_format": "sse", "marks": True}
    status, raw, _ = post(stack, "/v1/audio/speech", body)
    assert status == 200, raw[:300]
    streamed, done = sse_received(raw, 2, "<i2")
    assert streamed.samples == plain.size and streamed.marks == received.marks == done["marks"]
    status, raw, _ = post(stack, "/v1/audio/speech", {**body, "stream_format": "audio"})
    assert status == 400 and b'"marks"' in raw


def test_websocket_marks_come_before_their_audio(stack, reference):
    plain, received, _ = reference

    async def session() -> Received:
        from cosyvoice_triton.pipeline.speech_marks import event_of

        got = Received()
        async with aiohttp.ClientSession(timeout=TIMEOUT) as client:
            async with client.ws_connect(stack.gateway_url.replace("http", "ws") + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": "default", "seed": SEED, "text_type": "ssml",
                                    "marks": True, "text": SSML})
                await ws.send_json({"type": "end"})
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        got.chunk(np.frombuffer(message.data, "<f4"))
                    elif (event := event_of(message.json())) is not None:
                        got.event(event)
                    elif message.json()["type"] in ("end", "error"):
                        assert message.json()["type"] == "end", message.data
                        break
        return got

    got = asyncio.run(session())
    np.testing.assert_array_equal(got.waveform, plain)
    assert got.marks == received.marks


def test_gateway_sdks_and_cli_give_the_same_marks(stack, reference, tmp_path):
    from cosyvoice_triton.client import AsyncGatewayTTS, GatewayTTS
    from cosyvoice_triton.client.cli import main

    plain, received, offline = reference
    options = {"voice_id": "default", "seed": SEED, "marks": True}
    with GatewayTTS(stack.gateway_url) as tts:
        whole = tts.synthesize(SSML, **options)
        assert whole.marks == received.marks
        np.testing.assert_array_equal(whole, offline)
        for stream in (tts.stream(SSML, **options), tts.stream_ws(SSML, text_type="ssml", **options)):
            got = Received()
            with stream as chunks:
                for chunk in chunks:
                    for event in chunk.marks:
                        got.event(event)
                    got.chunk(chunk)
            got.close(chunks.marks)
            assert got.marks == received.marks
            np.testing.assert_array_equal(got.waveform, plain)

    async def async_client() -> tuple[list[dict], list[dict]]:
        async with AsyncGatewayTTS(stack.gateway_url) as tts:
            whole = await tts.synthesize(SSML, **options)
            async with await tts.stream(SSML, **options) as chunks:
                async for _ in chunks:
                    pass
            return whole.marks, chunks.marks

    assert asyncio.run(async_client()) == (received.marks, received.marks)
    out, marks = tmp_path / "a.wav", tmp_path / "marks.json"
    assert main(["synth", "--url", stack.gateway_url, "--voice", "default", "--seed", str(SEED), "--text", SSML,
                 "--out", str(out), "--marks", str(marks)]) == 0
    assert json.loads(marks.read_text()) == received.marks
    assert main(["synth", "--triton", stack.triton.grpc_url, "--voice", "default", "--seed", str(SEED),
                 "--text", SSML, "--out", str(out), "--marks", str(marks)]) == 0
    assert json.loads(marks.read_text()) == received.marks


def test_plain_text_marks_on_the_gateway(stack):
    text = "  Good morning, and welcome to 2 days of fun!  "
    status, raw, _ = post(stack, "/v1/tts", {"text": text, "voice_id": "default", "seed": SEED, "format": "pcm_f32",
                                             "marks": True})
    answer = json.loads(raw)
    audio = np.frombuffer(base64.b64decode(answer["audio"]), "<f4")
    assert [(m["start"], m["end"], m["value"]) for m in answer["marks"]] == [
        (2, 45, "Good morning, and welcome to 2 days of fun!")]
    check_tiling(answer["marks"], audio.size)
    status, raw, _ = post(stack, "/v1/tts", {"text": "Hi.", "marks": "yes"})
    assert status == 400 and b'"marks"' in raw
    status, raw, _ = post(stack, "/v1/tts", {"text": "Hi.", "marks": True, "text_mode": "bistream"})
    assert status == 400


def test_websocket_segments_count_in_the_session(stack):
    from cosyvoice_triton.client import GatewayTTS

    pieces = ["Hello there. ", "How are ", "you today? "]
    session = "".join(pieces)
    with GatewayTTS(stack.gateway_url) as tts:
        got = Received()
        with tts.stream_ws(iter(pieces), voice_id="default", seed=SEED, marks=True) as chunks:
            for chunk in chunks:
                for event in chunk.marks:
                    got.event(event)
                got.chunk(chunk)
        got.close(chunks.marks)
        assert len(chunks.stats.segments) == 2
    assert [(m["value"], session[m["start"]:m["end"]]) for m in got.marks] == [
        ("Hello there.", "Hello there."), ("How are you today?", "How are you today?")]
    check_tiling(got.marks, got.samples)
