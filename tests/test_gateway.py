"""The gateway against a real tritonserver: every endpoint, audio equal to Triton's own, the OpenAI client,
WebSocket text-in streaming, per-request chunk-policy overrides, cancellation, keys and limits.

One tritonserver for the module (started like `cosyvoice-triton serve`, on free ports, a tiny random model,
max_token_text_ratio 3 to keep outputs short) and two gateways in this process (`GatewayThread`): an open
one, and one with API keys and small limits. References come from the server directly over gRPC
streaming (tests/triton_harness.GrpcStream) with the same inputs and seed.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import struct
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import soundfile as sf

from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.audio_out import encode
from cosyvoice_triton.gateway.config import GatewayConfig, Limits, RoutingConfig
from cosyvoice_triton.gateway.routes_ws import SentenceBuffer
from cosyvoice_triton.gateway.fields import TTS_FIELDS
from cosyvoice_triton.gateway.errors import http_status, upstream
from cosyvoice_triton.errors import InvalidInput, from_wire
from cosyvoice_triton.gateway.testing import GatewayThread
from cosyvoice_triton.wire.requests import SynthesisInputs
from cosyvoice_triton.client.triton_client import synthesis_request
from triton_harness import GrpcStream, metric_value, scrape, tritonserver_or_skip, wait_for_metric

pytestmark = pytest.mark.timeout(300)

RATIO = 3.0
RATE = 16000
PROMPT_TEXT = "a short voice prompt"
TEXT = "The streamed reply is made of several chunks. A second sentence makes it a little longer."
ATOL = 2e-4  # batched flow/vocoder calls may add float rounding (see test_triton_serving)
# Many sentences: the random LLM may draw a stop token early in any one, and the stream still runs on.
ENDLESS = " ".join(["This sentence keeps the stream going on and on."] * 25)
KEYS = ("key-one", "key-two")
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=120)


def to_s16(samples: np.ndarray) -> np.ndarray:
    """16-bit samples as the gateway's pcm format makes them."""
    return np.frombuffer(encode(samples, "pcm"), "<i2")


# ---- fixtures -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def triton(tiny_model_dir, tmp_path_factory):
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    binary = tritonserver_or_skip()
    run_dir = tmp_path_factory.mktemp("gateway-triton")
    options = ServeOptions(model_dir=tiny_model_dir, run_dir=run_dir, address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, voice_store=str(run_dir / "voices.sqlite"),
                           max_token_text_ratio=RATIO, torch_threads=1, workers=8)
    server = prepare(options, binary=binary, die_with_parent=True)
    server.start()
    yield server
    server.stop()


def gateway_config(triton, tiny_model_dir: Path, home: Path, **overrides) -> GatewayConfig:
    return GatewayConfig(triton=(triton.target,),
                         voice_store=str(triton.workdir / "voices.sqlite"), model_dir=tiny_model_dir, home=home,
                         routing=RoutingConfig(health_interval_s=1.0, metrics_interval_s=1.0), **overrides)


@pytest.fixture(scope="module")
def gateway(triton, tiny_model_dir, tmp_path_factory):
    with GatewayThread(gateway_config(triton, tiny_model_dir, tmp_path_factory.mktemp("home"))) as gw:
        gw.wait_ready()
        yield gw


@pytest.fixture(scope="module")
def locked(triton, tiny_model_dir, tmp_path_factory, gateway):
    """API keys on; small limits (uploads of 100 kB, one stream per key, 300 characters)."""
    config = gateway_config(triton, tiny_model_dir, tmp_path_factory.mktemp("home"), api_keys=frozenset(KEYS),
                            limits=Limits(max_text_chars=300, max_upload_bytes=100_000, max_streams_per_key=1),
                            default_voice=False)
    with GatewayThread(config) as gw:
        gw.wait_ready()
        yield gw


def wav_file(samples: np.ndarray, rate: int = RATE, subtype: str = "PCM_16") -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, rate, format="WAV", subtype=subtype)
    return out.getvalue()


PROMPT_WAV = wav_file(speech_like(2.0, RATE, seed=3, pitch_hz=110.0))


@pytest.fixture(scope="module")
def voice_id(gateway) -> str:
    status, body = run(register(gateway.url, PROMPT_WAV, PROMPT_TEXT))
    assert status in (200, 201), body
    return body["id"]


def run(coro):
    return asyncio.run(coro)


async def register(url: str, audio: bytes, text: str, headers=None, **fields) -> tuple[int, dict]:
    form = aiohttp.FormData()
    form.add_field("audio", audio, filename="prompt.wav", content_type="audio/wav")
    form.add_field("text", text)
    for key, value in fields.items():
        form.add_field(key, value)
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        async with session.post(url + "/v1/voices", data=form, headers=headers) as response:
            return response.status, await response.json()


async def post_json(url: str, body, headers=None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        kwargs = {"data": body} if isinstance(body, (str, bytes)) else {"json": body}
        async with session.post(url, headers=headers, **kwargs) as response:
            return response.status, dict(response.headers), await response.read()


async def post_stream(url: str, body: dict) -> tuple[dict, list[bytes]]:
    """The body of a streamed response as its HTTP chunks."""
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        async with session.post(url, json=body) as response:
            assert response.status == 200, await response.text()
            chunks, current = [], b""
            async for data, end_of_chunk in response.content.iter_chunks():
                current += data
                if end_of_chunk:
                    chunks.append(current)
                    current = b""
            assert current == b""
            return dict(response.headers), [c for c in chunks if c]  # not the empty last chunk


def direct(triton, text: str, seed: int, **voice) -> list[np.ndarray]:
    """The server's own chunks for a cosyvoice2 request (gRPC streaming, no gateway)."""
    with GrpcStream(triton.grpc_url, timeout_s=120) as stream:
        responses = stream.infer("cosyvoice2", synthesis_request(text, seed=seed, **voice).tensors())
    errors = [r.error for r in responses if r.error]
    assert not errors, errors
    return [r.outputs["waveform"] for r in responses if r.outputs.get("waveform") is not None
            and r.outputs["waveform"].size]


@pytest.fixture(scope="module")
def reference(triton, voice_id) -> list[np.ndarray]:
    return direct(triton, TEXT, seed=7, voice_id=voice_id)


@pytest.fixture(scope="module")
def offline_reference(triton, voice_id) -> np.ndarray:
    """The offline twin's waveform (cosyvoice2_offline), which non-streamed gateway requests get."""
    from cosyvoice_triton.client import TritonTTS

    with TritonTTS(triton.grpc_url) as tts:
        return tts.synthesize(TEXT, voice_id=voice_id, seed=7, offline=True)


def error_param(body: bytes | dict) -> tuple[str, str]:
    data = json.loads(body) if isinstance(body, bytes) else body
    return data["error"]["param"], data["error"]["code"]


def shipped_default_voice(voice: dict) -> dict:
    """`voice` if it was registered from the recording that ships in gateway/assets (else an assertion)."""
    from cosyvoice_triton.preprocess.audio import load_prompt_audio
    from cosyvoice_triton.preprocess.voice_features import audio_sha256
    from cosyvoice_triton.gateway.default_voice import RECORDING, TRANSCRIPT

    samples, rate = load_prompt_audio(RECORDING.read_bytes(), "audio")
    assert voice["text"] == TRANSCRIPT and voice["audio_sha256"] == audio_sha256(samples, rate)
    assert voice["prompt_seconds"] == pytest.approx(samples.size / rate, abs=0.1)  # 25 speech tokens a second
    return voice


def metric(url: str, name: str, **labels) -> float:
    return metric_value(scrape(url), name, **labels) or 0.0


# ---- health, readiness, the default voice -------------------------------------------------------------

def test_health_readiness_and_the_default_voice(gateway):
    assert gateway.get_json("/healthz") == (200, {"status": "ok"})
    status, ready = gateway.get_json("/readyz")
    assert status == 200 and ready["default_voice"] == "ready" and all(ready["servers"].values())
    deadline = time.monotonic() + 30
    while not ready["precision"] and time.monotonic() < deadline:  # known from the first metrics scrape on
        time.sleep(0.5)
        ready = gateway.get_json("/readyz")[1]
    assert list(ready["precision"].values()) == [{"llm": "fp32", "flow": "fp32"}]  # as the server's metrics say
    status, voices = gateway.get_json("/v1/voices")
    default = [v for v in voices["voices"] if v["id"] == "default"]
    assert status == 200 and default == [shipped_default_voice(default[0])]
    status, _, body = run(post_json(gateway.url + "/v1/tts", {"text": "The default voice speaks.", "seed": 1}))
    assert status == 200
    audio, rate = sf.read(io.BytesIO(body), dtype="float32")
    assert rate == 24000 and audio.size > 0


async def get(url: str) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        async with session.get(url) as response:
            return response.status, response.content_type, await response.read()


def test_the_page_and_its_assets_are_served(gateway):
    """GET / without a browser (tests/test_web_page.py plays it in Chromium): the page, its script and its
    style sheet, with the controls the script drives."""
    status, content_type, page = run(get(gateway.url + "/"))
    assert status == 200 and content_type == "text/html"
    html = page.decode()
    for control in ('id="voice"', 'id="text"', 'id="speak"', 'id="first-chunk"', 'id="voice-file"', 'id="record"'):
        assert control in html, control
    for asset, kind in (("/static/app.js", "javascript"), ("/static/style.css", "text/css")):
        status, content_type, body = run(get(gateway.url + asset))
        assert status == 200 and kind in content_type and body, asset
    status, _, script = run(get(gateway.url + "/static/app.js"))
    assert b"/v1/tts/ws" in script and b"/v1/voices" in script  # the page calls the gateway's own API


# ---- /v1/tts ------------------------------------------------------------------------------------------

def test_streamed_pcm_equals_triton_output_chunk_for_chunk(gateway, voice_id, reference):
    headers, chunks = run(post_stream(gateway.url + "/v1/tts", {"text": TEXT, "voice_id": voice_id, "seed": 7,
                                                                 "format": "pcm_f32", "stream": True}))
    assert headers["Transfer-Encoding"] == "chunked" and headers["X-Seed"] == "7"
    assert headers["X-Sample-Rate"] == "24000"
    assert len(reference) >= 2
    assert len(chunks) == len(reference)  # one HTTP chunk per Triton chunk, flushed as it came
    for got, want in zip(chunks, reference, strict=True):
        np.testing.assert_allclose(np.frombuffer(got, "<f4"), want, rtol=0, atol=ATOL)


def test_whole_wav_and_streamed_wav_and_s16(gateway, voice_id, reference, offline_reference):
    want = to_s16(offline_reference).astype(np.int32)  # not streamed: the offline twin's audio
    status, headers, body = run(post_json(gateway.url + "/v1/tts", {"text": TEXT, "voice_id": voice_id, "seed": 7}))
    assert status == 200 and headers["Content-Type"] == "audio/wav" and int(headers["Content-Length"]) == len(body)
    audio, rate = sf.read(io.BytesIO(body), dtype="int16")
    assert rate == 24000
    assert np.abs(audio.astype(np.int32) - want).max() <= 8  # ATOL in 16-bit steps

    _, chunks = run(post_stream(gateway.url + "/v1/tts", {"text": TEXT, "voice_id": voice_id, "seed": 7,
                                                           "stream": True}))
    header, data = b"".join(chunks)[:44], b"".join(chunks)[44:]
    assert header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt " and header[36:40] == b"data"
    assert struct.unpack("<I", header[4:8])[0] == 0xFFFFFFFF and struct.unpack("<I", header[40:44])[0] == 0xFFFFFFFF
    streamed = np.frombuffer(data, "<i2").astype(np.int32)
    assert np.abs(streamed - to_s16(np.concatenate(reference)).astype(np.int32)).max() <= 8

    status, _, raw = run(post_json(gateway.url + "/v1/tts", {"text": TEXT, "voice_id": voice_id, "seed": 7,
                                                              "format": "pcm_s16le"}))
    assert status == 200 and np.abs(np.frombuffer(raw, "<i2").astype(np.int32) - want).max() <= 8


def test_a_prompt_recording_instead_of_a_voice_id(gateway, triton):
    text = "A prompt recording sent with the request."
    body = {"text": text, "prompt_audio": base64.b64encode(PROMPT_WAV).decode(), "prompt_text": PROMPT_TEXT,
            "seed": 21, "format": "pcm_f32", "stream": True}  # streamed: the chunks of `direct`
    status, headers, raw = run(post_json(gateway.url + "/v1/tts", body))
    assert status == 200, raw[:300]
    want = direct(triton, text, 21, prompt_text=PROMPT_TEXT, prompt_audio=PROMPT_WAV)
    np.testing.assert_allclose(np.frombuffer(raw, "<f4"), np.concatenate(want), rtol=0, atol=ATOL)


SILENCE_WAV = wav_file(np.zeros(RATE, np.float32))
GOOD_AUDIO = base64.b64encode(PROMPT_WAV).decode()


@pytest.mark.parametrize("body, status, param", [
    ({"text": "   "}, 400, "text"),
    ({"text": 12}, 400, "text"),
    ({"text": "x" * 2001}, 400, "text"),
    ({"voice_id": "default"}, 400, "text"),
    ({"text": "Hi.", "mode": "sing"}, 400, "mode"),
    ({"text": "Hi.", "mode": "instruct2"}, 400, "instruct"),
    ({"text": "Hi.", "seed": -1}, 400, "seed"),
    ({"text": "Hi.", "seed": "7"}, 400, "seed"),
    ({"text": "Hi.", "format": "ogg"}, 400, "format"),
    ({"text": "Hi.", "stream": "yes"}, 400, "stream"),
    ({"text": "Hi.", "voice_id": "not a valid id!"}, 400, "voice_id"),
    ({"text": "Hi.", "voice_id": "nobody"}, 404, "voice_id"),
    ({"text": "Hi.", "prompt_audio": "%%% not base64"}, 400, "prompt_audio"),
    ({"text": "Hi.", "prompt_audio": base64.b64encode(b"RIFF junk").decode(), "prompt_text": "x"}, 400,
     "prompt_audio"),
    ({"text": "Hi.", "prompt_audio": base64.b64encode(SILENCE_WAV).decode(), "prompt_text": "x"}, 400,
     "prompt_audio"),
    ({"text": "Hi.", "prompt_audio": GOOD_AUDIO}, 400, "prompt_text"),
    ({"text": "Hi.", "voice_id": "default", "prompt_audio": GOOD_AUDIO}, 400, "voice_id"),
    ({"text": "Hi.", "colour": "blue"}, 400, "colour"),
    ({"text": "Hi.", "chunk_first_hop": 0}, 400, "chunk_first_hop"),
    ({"text": "Hi.", "chunk_first_hop": "10"}, 400, "chunk_first_hop"),
    ({"text": "Hi.", "chunk_first_hop": 10.5}, 400, "chunk_first_hop"),
    ({"text": "Hi.", "chunk_first_hop": 2**31}, 400, "chunk_first_hop"),  # past INT32
    ({"text": "Hi.", "chunk_hop_scale": 0.5}, 400, "chunk_hop_scale"),
    ({"text": "Hi.", "chunk_hop_scale": True}, 400, "chunk_hop_scale"),
    ({"text": "Hi.", "chunk_first_hop": 50, "chunk_max_hop": 20}, 400, "chunk_max_hop"),
    ("{not json", 400, "body"),
    ([1, 2], 400, "body"),
])
def test_bad_inputs_get_a_4xx_naming_the_field(gateway, body, status, param):
    got, headers, raw = run(post_json(gateway.url + "/v1/tts", body, headers={"Content-Type": "application/json"}))
    assert got == status and headers["Content-Type"].startswith("application/json")
    assert error_param(raw)[0] == param, raw


# ---- chunk-policy overrides ----------------------------------------------------------------------------

FIRST_HOP = 4  # the smallest first hop (pipeline/chunk_policy.py); the default is 25 tokens


@pytest.mark.parametrize("overrides", [
    {"chunk_first_hop": FIRST_HOP},
    {"chunk_first_hop": 8, "chunk_hop_scale": 1, "chunk_max_hop": 8},  # fixed hops of 8 (1: a JSON int)
], ids=["small-first", "fixed-8"])
def test_chunk_policy_overrides_reach_the_model(gateway, triton, voice_id, reference, overrides):
    """The same speech tokens (the LLM does not see the chunking), cut into more and smaller chunks; the audio
    is Triton's for the same overrides, chunk for chunk (not the default's: the flow's chunks fall elsewhere)."""
    body = {"text": TEXT, "voice_id": voice_id, "seed": 7, "format": "pcm_f32", "stream": True, **overrides}
    _, chunks = run(post_stream(gateway.url + "/v1/tts", body))
    got = [np.frombuffer(chunk, "<f4") for chunk in chunks]
    want = direct(triton, TEXT, 7, voice_id=voice_id, **overrides)
    assert len(got) == len(want) > len(reference)
    assert got[0].size < reference[0].size
    assert sum(c.size for c in got) == sum(c.size for c in reference)
    for chunk, expected in zip(got, want, strict=True):
        np.testing.assert_allclose(chunk, expected, rtol=0, atol=ATOL)


def test_websocket_segments_keep_the_start_messages_chunk_policy(gateway, triton, voice_id):
    first, second = "The first sentence arrives on its own. ", "Then a second one follows it"

    async def session():
        frames, messages, segment = [[], []], [], 0
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            async with http.ws_connect(gateway.url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": voice_id, "seed": 11, "format": "pcm_f32",
                                    "chunk_first_hop": FIRST_HOP, "text": first + second})
                await ws.send_json({"type": "end"})
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:  # one frame per Triton chunk
                        frames[segment].append(np.frombuffer(message.data, "<f4"))
                    else:
                        messages.append(json.loads(message.data))
                        if messages[-1]["type"] == "segment":
                            segment += 1
        return frames, messages

    frames, messages = run(session())
    assert [m["type"] for m in messages] == ["started", "segment", "segment", "end"]
    for index, (text, seed) in enumerate([(first, 11), (second, 11 + 1000)]):
        want = direct(triton, text, seed, voice_id=voice_id, chunk_first_hop=FIRST_HOP)
        default = direct(triton, text, seed, voice_id=voice_id)
        assert len(frames[index]) == len(want) > len(default)
        for chunk, expected in zip(frames[index], want, strict=True):
            np.testing.assert_allclose(chunk, expected, rtol=0, atol=ATOL)


def test_chunk_overrides_are_sent_only_when_given_and_triton_errors_on_them_name_the_field():
    session = SynthesisInputs(text="", seed=1, voice_id="default", chunk_overrides={"hop_scale": 1.5})
    inputs = replace(session, text="Hi.", seed=2).tensors()  # a WebSocket segment
    assert inputs["chunk_hop_scale"].dtype == np.float32 and inputs["chunk_hop_scale"].tolist() == [1.5]
    assert "chunk_first_hop" not in inputs and "chunk_max_hop" not in inputs
    assert "chunk_hop_scale" not in replace(session, chunk_overrides={}).tensors()
    # a server with another default policy may refuse what the gateway let through: its error names the field
    refused = InvalidInput("chunk_max_hop", "must be >= first hop 60, got 50").to_wire()
    error = upstream(from_wire(refused), TTS_FIELDS)
    assert (http_status(error), error.field, error.message) == (400, "chunk_max_hop",
                                                               "chunk_max_hop: must be >= first hop 60, got 50")


# ---- OpenAI-compatible --------------------------------------------------------------------------------

def test_the_official_openai_client(gateway, voice_id, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    pcm = client.audio.speech.create(model="tts-1", voice=voice_id, input=TEXT, response_format="pcm",
                                     extra_body={"seed": 7})
    want = to_s16(np.concatenate(reference)).astype(np.int32)
    assert np.abs(np.frombuffer(pcm.content, "<i2").astype(np.int32) - want).max() <= 8

    with client.audio.speech.with_streaming_response.create(model="gpt-4o-mini-tts", voice="alloy",
                                                            input="Streaming through the OpenAI client.",
                                                            response_format="wav", speed=1.0) as response:
        assert response.headers["content-type"] == "audio/wav"
        parts = list(response.iter_bytes())
    data = b"".join(parts)
    assert data[:4] == b"RIFF" and len(data) > 44 and (len(data) - 44) % 2 == 0

    for kwargs, param in [({"input": ""}, "input"), ({"input": "Hi.", "response_format": "ogg"}, "response_format"),
                          ({"input": "Hi.", "speed": 9.0}, "speed"), ({"input": "Hi.", "voice": "nobody"}, "voice")]:
        kwargs = {"model": "tts-1", "voice": voice_id, "response_format": "wav", **kwargs}
        with pytest.raises(openai.APIStatusError) as info:
            client.audio.speech.create(**kwargs)
        assert info.value.status_code in (400, 404) and info.value.body["param"] == param


def test_openai_server_sent_events(gateway, voice_id, reference):
    async def events():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            body = {"model": "tts-1", "voice": voice_id, "input": TEXT, "response_format": "pcm",
                    "stream_format": "sse", "seed": 7}
            async with session.post(gateway.url + "/v1/audio/speech", json=body) as response:
                assert response.headers["Content-Type"].startswith("text/event-stream")
                text = (await response.read()).decode()
        return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]

    got = run(events())
    assert [e["type"] for e in got] == ["speech.audio.delta"] * len(reference) + ["speech.audio.done"]
    audio = np.frombuffer(b"".join(base64.b64decode(e["audio"]) for e in got[:-1]), "<i2").astype(np.int32)
    assert np.abs(audio - to_s16(np.concatenate(reference)).astype(np.int32)).max() <= 8


# ---- WebSocket --------------------------------------------------------------------------------------

def test_sentence_buffer_cuts_complete_sentences_only():
    buffer = SentenceBuffer(max_chars=40)
    assert buffer.feed("Hello there") == []
    assert buffer.feed(". How are") == ["Hello there. "]
    assert buffer.feed(" you? I am") == ["How are you? "]
    assert buffer.feed(" fine") == []
    assert buffer.flush() == ["I am fine"]
    assert buffer.feed("One. Two! Three") == ["One. Two! "]  # what is complete goes as one segment
    assert buffer.flush() == ["Three"]
    assert buffer.feed("你好。今天") == ["你好。"]
    assert buffer.feed("...") == [] and buffer.flush() == ["今天..."]
    assert buffer.feed("3.14 is pi") == [] and buffer.flush() == ["3.14 is pi"]
    long = buffer.feed("word " * 20)  # no sentence end past max_chars: cut at a space
    assert long and all(len(p) <= 40 for p in long) and "".join(long + buffer.flush()) == "word " * 20
    assert buffer.feed("!!! ") == []  # nothing speakable


def test_websocket_text_in_streaming(gateway, triton, voice_id):
    first, second = "The first sentence arrives on its own. ", "Then a second one follows it"

    async def session():
        frames, messages = [], []
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            async with http.ws_connect(gateway.url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": voice_id, "seed": 11, "format": "pcm_f32"})
                messages.append(await ws.receive_json())
                await ws.send_json({"type": "text", "text": first})
                # the first sentence is complete: its audio comes before any more text is sent
                message = await ws.receive()
                assert message.type == aiohttp.WSMsgType.BINARY
                frames.append((0, message.data))
                await ws.send_json({"type": "text", "text": second})
                await ws.send_json({"type": "end"})
                segment = 0
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        frames.append((segment, message.data))
                    else:
                        messages.append(json.loads(message.data))
                        if messages[-1]["type"] == "segment":
                            segment += 1
                close_code = ws.close_code
        return frames, messages, close_code

    frames, messages, close_code = run(session())
    assert close_code == 1000
    assert [m["type"] for m in messages] == ["started", "segment", "segment", "end"]
    assert messages[0]["sample_rate"] == 24000 and messages[0]["seed"] == 11
    assert [m["text"] for m in messages[1:3]] == [first, second]
    end = messages[-1]
    assert end["segments"] == 2 and end["first_chunk_ms"] > 0
    assert end["first_audible_ms"] >= end["first_chunk_ms"]  # noise: audible in its first chunk or later
    want = [direct(triton, first, 11, voice_id=voice_id), direct(triton, second, 11 + 1000, voice_id=voice_id)]
    for index in (0, 1):  # each segment's audio, in order, before its segment message
        got = np.frombuffer(b"".join(data for seg, data in frames if seg == index), "<f4")
        np.testing.assert_allclose(got, np.concatenate(want[index]), rtol=0, atol=ATOL)
        assert messages[1 + index]["audio_seconds"] == pytest.approx(got.size / 24000)
    assert end["audio_seconds"] == pytest.approx(sum(np.concatenate(w).size for w in want) / 24000)


@pytest.mark.parametrize("transport", ["websocket", "websocket_reset", "http"])
def test_a_client_that_leaves_mid_stream_frees_its_triton_stream(gateway, triton, voice_id, transport):
    # Counted where the request ends (cosyvoice2), not at the LLM: the random LLM may have finished the
    # sentence it was on when the cancel came. That nothing stays held is checked below.
    before = metric(triton.metrics_url, "cosyvoice_requests_total", model="cosyvoice2", outcome="cancelled")
    gateway_metrics = gateway.url + "/metrics"
    route = "/v1/tts/ws" if transport.startswith("websocket") else "/v1/tts"
    left_before = metric(gateway_metrics, "cosyvoice_gateway_requests_total", route=route, status="cancelled") or 0
    internal_before = metric(gateway_metrics, "cosyvoice_gateway_errors_total", kind="internal") or 0

    async def leave_after_first_audio():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            if transport.startswith("websocket"):
                async with http.ws_connect(gateway.url + "/v1/tts/ws") as ws:
                    await ws.send_json({"type": "start", "voice_id": voice_id, "seed": 404})
                    assert (await ws.receive_json())["type"] == "started"
                    await ws.send_json({"type": "text", "text": ENDLESS})
                    await ws.send_json({"type": "end"})
                    assert (await ws.receive()).type == aiohttp.WSMsgType.BINARY
                    if transport == "websocket_reset":  # gone without a close frame: the connection is cut
                        ws._conn.transport.abort()
            else:
                body = {"text": ENDLESS, "voice_id": voice_id, "seed": 404, "stream": True, "format": "pcm_f32"}
                async with http.post(gateway.url + "/v1/tts", json=body) as response:
                    assert response.status == 200 and await response.content.readany()
        # leaving the blocks closes the socket with most of the audio still to come

    run(leave_after_first_audio())
    wait_for_metric(triton.metrics_url, "cosyvoice_requests_total", lambda v: v is not None and v >= before + 1,
                    model="cosyvoice2", outcome="cancelled")
    for name, model in (("cosyvoice_llm_active_streams", "llm"), ("cosyvoice_token2wav_active_streams", "token2wav"),
                        ("cosyvoice_active_streams", "cosyvoice2")):
        wait_for_metric(triton.metrics_url, name, lambda v: v == 0, model=model)
    assert metric(triton.metrics_url, "cosyvoice_llm_free_slots", model="llm") == 8
    wait_for_metric(gateway_metrics, "cosyvoice_gateway_active_streams", lambda v: v == 0,
                    route="ws" if transport.startswith("websocket") else "tts")
    # the gateway counts the request as the client's leaving, not as its own failure
    wait_for_metric(gateway_metrics, "cosyvoice_gateway_requests_total", lambda v: (v or 0) >= left_before + 1,
                    route=route, status="cancelled")
    assert (metric(gateway_metrics, "cosyvoice_gateway_errors_total", kind="internal") or 0) == internal_before


def test_a_send_that_fails_because_the_client_left_is_the_leaving_not_an_error():
    """The reader sees the client's close and the sender's write fails on the closing socket at once: the
    session is the client's cancellation whichever task asyncio lists first (was an `internal` error)."""
    from cosyvoice_triton.errors import Cancelled
    from cosyvoice_triton.gateway.routes_ws import client_left, session_error

    async def raising(exc):
        raise exc

    async def outcomes():
        left = Cancelled("the client closed the WebSocket")
        for order in ((ConnectionResetError("Cannot write to closing transport"), left),
                      (left, ConnectionResetError("Cannot write to closing transport"))):
            tasks = [asyncio.create_task(raising(exc)) for exc in order]
            await asyncio.wait(tasks)
            yield session_error(set(tasks))
        failed = asyncio.create_task(raising(ValueError("bad")))
        await asyncio.wait([failed])
        yield session_error({failed})

    async def collect():
        return [error async for error in outcomes()]

    first, second, other = run(collect())
    assert client_left(first) and client_left(second)
    assert isinstance(other, ValueError) and not client_left(other)
    assert session_error(set()) is None


def test_websocket_errors_are_messages_with_codes(gateway):
    async def first_reply(*messages):
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            async with http.ws_connect(gateway.url + "/v1/tts/ws") as ws:
                for message in messages:
                    await ws.send_json(message)
                reply = await ws.receive_json()
                while reply["type"] == "started":
                    reply = await ws.receive_json()
                await ws.receive()
                return reply, ws.close_code

    cases = [([{"type": "text", "text": "no start"}], "type", 400),
             ([{"type": "start", "format": "ogg"}], "format", 400),
             ([{"type": "start", "voice_id": "nobody"}], "voice_id", 404),
             ([{"type": "start", "chunk_hop_scale": "fast"}], "chunk_hop_scale", 400),
             ([{"type": "start", "chunk_first_hop": 1}], "chunk_first_hop", 400),
             ([{"type": "start"}, {"type": "text", "text": 5}], "text", 400),
             ([{"type": "start"}, {"type": "sing"}], "type", 400)]
    for messages, param, status in cases:
        reply, close_code = run(first_reply(*messages))
        assert reply["type"] == "error" and reply["param"] == param and reply["status"] == status, reply
        assert close_code == 1008


def test_shutdown_closes_websockets_with_going_away(triton, tiny_model_dir, tmp_path, gateway):
    gw = GatewayThread(gateway_config(triton, tiny_model_dir, tmp_path, default_voice=False)).start()

    async def session():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            async with http.ws_connect(gw.url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start"})
                assert (await ws.receive_json())["type"] == "started"
                stopping = asyncio.get_running_loop().run_in_executor(None, gw.stop)
                message = await ws.receive()
                await stopping
                return message.type, ws.close_code

    try:
        assert run(session()) == (aiohttp.WSMsgType.CLOSE, aiohttp.WSCloseCode.GOING_AWAY)
    finally:
        gw.stop()


# ---- voices -----------------------------------------------------------------------------------------

def test_voice_api(gateway, voice_id):
    url = gateway.url
    status, again = run(register(url, PROMPT_WAV, PROMPT_TEXT))
    assert status == 200 and again["id"] == voice_id and again["created"] is False  # idempotent by audio hash
    other = wav_file(speech_like(1.5, RATE, seed=8))
    status, alice = run(register(url, other, "another prompt", id="alice", name="Alice"))
    assert status == 201 and alice["id"] == "alice" and alice["name"] == "Alice" and alice["created"]
    status, listed = gateway.get_json("/v1/voices")
    assert {"alice", voice_id, "default"} <= {v["id"] for v in listed["voices"]}
    status, shown = gateway.get_json("/v1/voices/alice")
    assert status == 200 and shown["text"] == "another prompt" and shown["prompt_tokens"] > 0

    async def json_registration():
        body = {"audio": base64.b64encode(other).decode(), "text": "another prompt"}
        return await post_json(url + "/v1/voices", body)

    status, _, raw = run(json_registration())
    assert status == 200 and json.loads(raw)["id"] == "alice"

    async def delete(voice):
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            async with session.delete(f"{url}/v1/voices/{voice}") as response:
                return response.status, await response.json()

    assert run(delete("alice")) == (200, {"id": "alice", "deleted": True})
    assert gateway.get_json("/v1/voices/alice")[0] == 404
    status, body = run(delete("alice"))
    assert status == 404 and error_param(body) == ("id", "not_found")

    for audio, text, param in [(SILENCE_WAV, "x", "audio"), (b"not audio at all", "x", "audio"),
                               (PROMPT_WAV, "x", "id")]:
        extra = {"id": "bad id!"} if param == "id" else {}
        status, body = run(register(url, audio, text, **extra))
        assert status == 400 and error_param(body)[0] == param, body


# ---- keys and limits ---------------------------------------------------------------------------------

def test_api_keys(locked, voice_id):
    status, _, body = run(post_json(locked.url + "/v1/tts", {"text": "Hi."}))
    assert status == 401 and error_param(body)[1] == "unauthorized"
    status, _, body = run(post_json(locked.url + "/v1/tts", {"text": "Hi."}, headers={"Authorization": "Bearer no"}))
    assert status == 401
    assert locked.get_json("/v1/voices")[0] == 401
    assert locked.get_json("/healthz")[0] == 200 and locked.get_json("/readyz")[0] == 200

    async def with_keys():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            async with http.get(locked.url + "/v1/voices", headers={"Authorization": f"Bearer {KEYS[0]}"}) as r:
                assert r.status == 200
            async with http.get(locked.url + "/v1/voices", headers={"X-API-Key": KEYS[1]}) as r:
                assert r.status == 200
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(locked.url + "/v1/tts/ws")
            assert refused.value.status == 401
            async with http.ws_connect(locked.url + f"/v1/tts/ws?api_key={KEYS[0]}") as ws:
                await ws.send_json({"type": "start", "voice_id": voice_id})
                assert (await ws.receive_json())["type"] == "started"

    run(with_keys())


def test_oversized_uploads_get_413(locked):
    big = wav_file(speech_like(4.0, RATE, seed=1))  # 128 kB > 100 kB
    for audio in (big, bytes(300_000)):  # over the audio limit; over the body limit too
        status, body = run(register(locked.url, audio, "too big", headers={"X-API-Key": KEYS[0]}))
        assert status == 413 and body["error"]["code"] == "too_large"
        assert re.search(r" is more than the limit of 0\.\d MB \(the gateway.s --max-upload-mb raises it\)",
                         body["error"]["message"]), body
    body = {"text": "Hi.", "prompt_audio": base64.b64encode(big).decode(), "prompt_text": "x"}
    status, _, raw = run(post_json(locked.url + "/v1/tts", body, headers={"X-API-Key": KEYS[0]}))
    assert status == 413
    status, _, raw = run(post_json(locked.url + "/v1/tts", {"text": "x" * 301}, headers={"X-API-Key": KEYS[0]}))
    assert status == 400 and error_param(raw)[0] == "text"


def test_concurrent_streams_per_key_are_limited(locked, voice_id):
    async def scenario():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            async with http.ws_connect(locked.url + f"/v1/tts/ws?api_key={KEYS[0]}") as ws:
                await ws.send_json({"type": "start", "voice_id": voice_id})
                assert (await ws.receive_json())["type"] == "started"
                # key one holds its only stream: a second one is refused, key two is not limited by it
                async with http.post(locked.url + "/v1/tts", json={"text": "Hi.", "voice_id": voice_id},
                                     headers={"X-API-Key": KEYS[0]}) as response:
                    assert response.status == 429
                    assert (await response.json())["error"]["code"] == "too_many_streams"
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(locked.url + f"/v1/tts/ws?api_key={KEYS[0]}")
                assert refused.value.status == 429
                async with http.ws_connect(locked.url + f"/v1/tts/ws?api_key={KEYS[1]}") as other:
                    await other.send_json({"type": "start", "voice_id": voice_id})
                    assert (await other.receive_json())["type"] == "started"

    run(scenario())


# ---- metrics ---------------------------------------------------------------------------------------

def test_gateway_metrics(gateway, triton):
    run(post_json(gateway.url + "/v1/tts", {"text": "Counted."}))
    run(post_json(gateway.url + "/v1/tts", {"text": ""}))
    run(post_json(gateway.url + "/v1/tts", {"text": "Hi.", "voice_id": "nobody"}))
    text = scrape(gateway.url + "/metrics")
    server = triton.grpc_url
    assert metric_value(text, "cosyvoice_gateway_requests_total", route="/v1/tts", status="200") >= 1
    assert metric_value(text, "cosyvoice_gateway_requests_total", route="/v1/tts", status="400") >= 1
    assert metric_value(text, "cosyvoice_gateway_first_chunk_seconds_count", route="tts") >= 1
    # the random model speaks noise: every stream has a first audible sample (pipeline/audible.py)
    assert metric_value(text, "cosyvoice_gateway_first_audible_seconds_count", route="tts") >= 1
    assert metric_value(text, "cosyvoice_gateway_active_streams", route="tts") == 0
    assert metric_value(text, "cosyvoice_gateway_outstanding_cost", server=server) == 0
    assert metric_value(text, "cosyvoice_gateway_server_healthy", server=server) == 1
    assert metric_value(text, "cosyvoice_gateway_server_pending", server=server) is not None
    assert metric_value(text, "cosyvoice_gateway_routed_total", server=server) >= 2
    assert metric_value(text, "cosyvoice_gateway_errors_total", kind="invalid_input") >= 1
    assert metric_value(text, "cosyvoice_gateway_errors_total", kind="not_found") >= 1
    assert metric_value(text, "cosyvoice_gateway_audio_seconds_total", route="tts") > 0


# ---- a finished stream's call ends with OK, never a cancel --------------------------------------------

def test_a_finished_stream_ends_its_grpc_call_with_ok_not_a_cancel(triton, voice_id):
    """After a stream's final response every client reads its ModelStreamInfer call to the server's OK
    instead of cancelling it (or dropping it, which cancels it): a cancel racing Triton 2.51's own end of
    the call can leave the request held in its gRPC frontend, so the model never unloads and tritonserver
    exits 1 at its exit timeout on every stop."""
    import grpc

    from cosyvoice_triton.client import AsyncTritonTTS, TritonTTS, TTSError
    from cosyvoice_triton.errors import RemoteError
    from cosyvoice_triton.gateway.triton_channel import TritonClient
    from cosyvoice_triton.client.triton_client import synthesis_request

    text = "A short finished stream."

    unknown = "v_0000000000000000"  # an error answer is the request's final response too

    async def gateway_channel(voice):
        client = TritonClient(triton.grpc_url)
        calls = []
        start = client._stub.ModelStreamInfer
        client._stub.ModelStreamInfer = lambda requests: calls.append(start(requests)) or calls[-1]
        try:
            request = synthesis_request(text, voice_id=voice, seed=1).tensors()
            chunks = [c async for c in client.stream("cosyvoice2", request, first_timeout_s=120, chunk_timeout_s=120)]
        except RemoteError as exc:
            chunks = exc.code
        finally:
            code = await calls[0].code()
            await client.close()
        return chunks, code

    chunks, code = run(gateway_channel(voice_id))
    assert len(chunks) > 0 and code == grpc.StatusCode.OK
    assert run(gateway_channel(unknown)) == ("not_found", grpc.StatusCode.OK)

    with TritonTTS(triton.grpc_url) as tts:
        stream = tts.stream(text, voice_id=voice_id, seed=1)
        assert list(stream)
        assert stream._call.code() == grpc.StatusCode.OK and not stream.cancelled
        stream = tts.stream(text, voice_id=unknown, seed=1)
        with pytest.raises(TTSError):
            list(stream)
        assert stream._call.code() == grpc.StatusCode.OK

    async def sdk_async(voice):
        async with AsyncTritonTTS(triton.grpc_url) as tts:
            stream = tts.stream(text, voice_id=voice, seed=1)
            try:
                chunks = [c async for c in stream]
            except TTSError:
                chunks = None
            return chunks, await stream._call.code()

    chunks, code = run(sdk_async(voice_id))
    assert chunks and code == grpc.StatusCode.OK
    assert run(sdk_async(unknown)) == (None, grpc.StatusCode.OK)
