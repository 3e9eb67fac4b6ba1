"""Audio formats and speed through the real service (tritonserver on the tiny random model + the gateway):
the official `openai` client on /v1/audio/speech with its defaults and every response_format, and the same
formats on POST /v1/tts, the WebSocket, the SDK's `synthesize_file` and `cosyvoice-client synth --format`.
Each answer is decoded with its real decoder (FFmpeg through PyAV; `wave` and soundfile for WAV) and
compared with the 16-bit PCM of the same text and seed. `speed` shortens the audio with the openai client
and gives the library's audio on /v1/tts (whole and streamed), the WebSocket, the SDK and the CLI. The
same stack serves the access-log and registration checks (test_access_log.py's unit tests aside)."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import re
import struct
import wave
from contextlib import contextmanager

import aiohttp
import av
import numpy as np
import pytest
import soundfile as sf

from cosyvoice_triton.audio_out import AudioEncoder, encode
from web.stack import serve_stack

openai = pytest.importorskip("openai")

TEXT = "The speech route answers in the format it is asked for. A second sentence makes more chunks."
SEED = 7
RATE = 24000
CONTAINERS = {"mp3": "mp3", "opus": "ogg", "aac": "aac", "flac": "flac", "wav": "wav"}
# Samples a decoder may add: encoder delay and the last frame's padding (mp3 streamed has no LAME header)
PADDING = {"mp3": 2 * 1152, "aac": 2 * 1024, "opus": 0, "flac": 0, "wav": 0}
TIMEOUT = aiohttp.ClientTimeout(total=120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    with serve_stack(tmp_path_factory.mktemp("openai_api"), tiny_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post_tts(url: str, body: dict) -> tuple[dict, bytes]:
    async def post():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(url + "/v1/tts", json=body) as response:
                assert response.status == 200, await response.text()
                return dict(response.headers), await response.read()

    return asyncio.run(post())


def pcm_f32(url: str, text: str, stream: bool) -> np.ndarray:
    _, raw = post_tts(url, {"text": text, "voice_id": "default", "seed": SEED, "format": "pcm_f32", "stream": stream})
    return np.frombuffer(raw, "<f4")


@pytest.fixture(scope="module")
def audio(stack) -> np.ndarray:
    """The model's streamed float32 samples for TEXT with SEED."""
    samples = pcm_f32(stack.gateway_url, TEXT, stream=True)
    assert samples.size > RATE // 2
    return samples


@pytest.fixture(scope="module")
def whole_audio(stack) -> np.ndarray:
    """The same, not streamed (the offline model's audio: one flow pass per sentence)."""
    return pcm_f32(stack.gateway_url, TEXT, stream=False)


def decode(data: bytes) -> tuple[np.ndarray, int, str]:
    """(int16 samples, rate, container name) through FFmpeg's demuxers and decoders."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        to_s16 = av.AudioResampler(format="s16", layout="mono")
        frames = [out.to_ndarray().reshape(-1) for frame in container.decode(stream) for out in to_s16.resample(frame)]
        return np.concatenate(frames), stream.rate, container.format.name


def check_decodes_like(data: bytes, fmt: str, audio: np.ndarray, streamed: bool = True) -> None:
    """`data` is a file of `fmt` holding the float32 samples `audio`: decoded, it is as long as they are
    (plus a lossy codec's padding) and holds the same samples (lossless), or decodes as the file that
    audio_out makes of them here does (lossy: the encoders are deterministic, whatever the chunking)."""
    pcm = np.frombuffer(encode(audio, "pcm"), "<i2").astype(np.int32)
    if fmt == "pcm":
        got = np.frombuffer(data, "<i2").astype(np.int32)
        assert got.size == pcm.size and np.abs(got - pcm).max() <= 8  # 16-bit steps of float rounding
        return
    samples, rate, container = decode(data)
    assert container == CONTAINERS[fmt] and rate == (48000 if fmt == "opus" else RATE)
    want = pcm.size * rate // RATE
    assert want <= samples.size <= want + PADDING[fmt] * rate // RATE, (fmt, samples.size, want)
    if fmt in ("flac", "wav"):  # lossless: the very samples
        assert samples.size == pcm.size and np.abs(samples.astype(np.int32) - pcm).max() <= 8
        return
    local = AudioEncoder(fmt)
    here, _, _ = decode(local.feed(audio) + local.finish() if streamed else encode(audio, fmt))
    assert here.size == samples.size
    assert np.corrcoef(here.astype(np.float64), samples.astype(np.float64))[0, 1] > 0.99, fmt


# ---- the official OpenAI client -------------------------------------------------------------------------

def test_the_default_format_is_mp3(client, audio):
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, extra_body={"seed": SEED})
    assert response.response.headers["content-type"] == "audio/mpeg"
    check_decodes_like(response.content, "mp3", audio)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_response_format_decodes_with_its_decoder(client, audio, fmt):
    media = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
             "pcm": "audio/pcm"}
    with client.audio.speech.with_streaming_response.create(model="gpt-4o-mini-tts", voice="default", input=TEXT,
                                                            response_format=fmt, speed=1.0,
                                                            extra_body={"seed": SEED}) as response:
        assert response.headers["content-type"] == media[fmt]
        assert response.headers["transfer-encoding"] == "chunked"
        reads = [part for part in response.iter_bytes() if part]
    assert len(reads) > 1  # streamed: the body came in pieces, not as one buffer at the end
    check_decodes_like(b"".join(reads), fmt, audio)


def test_streamed_wav_is_read_to_its_end_and_a_whole_wav_has_exact_lengths(client, audio, whole_audio):
    pcm = np.frombuffer(encode(audio, "pcm"), "<i2").astype(np.int32)
    streamed = client.audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="wav",
                                          extra_body={"seed": SEED}).content
    assert struct.unpack("<I", streamed[40:44])[0] == 0xFFFFFFFF  # "unknown length", as FFmpeg writes on a pipe
    samples, rate = sf.read(io.BytesIO(streamed), dtype="int16")
    assert rate == RATE and samples.size == pcm.size and np.abs(samples - pcm).max() <= 8
    with wave.open(io.BytesIO(streamed)) as w:  # wave trusts the header's count, and reads to the end
        assert len(w.readframes(w.getnframes())) == 2 * pcm.size

    whole = client.audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="wav",
                                       extra_body={"seed": SEED, "stream": False})
    assert int(whole.response.headers["content-length"]) == len(whole.content) == 44 + 2 * pcm.size
    with wave.open(io.BytesIO(whole.content)) as w:
        assert (w.getnframes(), w.getframerate(), w.getsampwidth()) == (pcm.size, RATE, 2)
    assert sf.info(io.BytesIO(whole.content)).frames == pcm.size
    check_decodes_like(whole.content, "wav", whole_audio, streamed=False)


def test_server_sent_events_carry_the_encoded_file(stack, audio):
    async def events() -> list[dict]:
        body = {"model": "tts-1", "voice": "default", "input": TEXT, "stream_format": "sse", "seed": SEED}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(stack.gateway_url + "/v1/audio/speech", json=body) as response:
                assert response.headers["Content-Type"].startswith("text/event-stream")
                text = (await response.read()).decode()
        return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]

    got = asyncio.run(events())
    assert [e["type"] for e in got[:-1]] == ["speech.audio.delta"] * (len(got) - 1) and len(got) > 2
    assert got[-1]["type"] == "speech.audio.done"
    check_decodes_like(b"".join(base64.b64decode(e["audio"]) for e in got[:-1]), "mp3", audio)  # the default


def test_speed_outside_the_range_and_unknown_formats_are_refused_naming_the_field(client):
    for speed in (9.0, 0.1):
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(model="tts-1", voice="default", input="Hi.", speed=speed)
        assert info.value.body["param"] == "speed"
    for fmt in ("ogg", "pcm_f32"):  # pcm_f32 is the gateway's own, not an OpenAI format
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(model="tts-1", voice="default", input="Hi.", response_format=fmt)
        assert info.value.body["param"] == "response_format"


def test_speed_with_the_openai_client_shortens_the_audio(client, audio):
    """speed=1.5: the same speech tokens (same seed), the mel interpolated to 1 / 1.5 of its frames."""
    fast = client.audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="pcm",
                                      speed=1.5, extra_body={"seed": SEED}).content
    samples = len(fast) // 2
    assert samples / audio.size == pytest.approx(1 / 1.5, rel=0.03)


# ---- the gateway's own routes, the SDK and the CLI --------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_v1_tts_whole_and_streamed(stack, audio, whole_audio, fmt):
    body = {"text": TEXT, "voice_id": "default", "seed": SEED, "format": fmt}
    headers, whole = post_tts(stack.gateway_url, {**body, "stream": False})
    assert int(headers["Content-Length"]) == len(whole) and headers["X-Audio-Format"] == fmt
    check_decodes_like(whole, fmt, whole_audio, streamed=False)
    if fmt == "wav":  # not streamed: the exact sample count in the header
        with wave.open(io.BytesIO(whole)) as w:
            assert w.getnframes() == whole_audio.size
    headers, streamed = post_tts(stack.gateway_url, {**body, "stream": True})
    assert headers["Transfer-Encoding"] == "chunked"
    check_decodes_like(streamed, fmt, audio)


def test_websocket_sends_the_bytes_of_one_file_per_session(stack):
    async def session(fmt: str) -> tuple[dict, bytes]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            async with http.ws_connect(stack.gateway_url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": "default", "seed": SEED, "format": fmt, "text": TEXT})
                await ws.send_json({"type": "end"})
                started, data = await ws.receive_json(), b""
                while True:
                    message = await ws.receive()
                    if message.type == aiohttp.WSMsgType.BINARY:
                        data += message.data
                    elif message.json()["type"] == "end":
                        return started, data
                    else:
                        assert message.json()["type"] == "segment", message.data

    started, raw = asyncio.run(session("pcm_f32"))
    assert (started["format"], started["sample_rate"]) == ("pcm_f32", RATE)
    audio = np.frombuffer(raw, "<f4")  # the session's two segments, in order
    for fmt in ("mp3", "opus", "aac", "flac", "wav", "pcm"):
        started, data = asyncio.run(session(fmt))
        assert started["format"] == fmt and started["sample_rate"] == (48000 if fmt == "opus" else RATE)
        check_decodes_like(data, fmt, audio)


def test_sdk_and_cli_formats(stack, whole_audio, tmp_path, capsys):
    from cosyvoice_triton.client import AsyncGatewayTTS, GatewayTTS
    from cosyvoice_triton.client.cli import main as cli_main

    with GatewayTTS(stack.gateway_url) as tts:
        flac = tts.synthesize_file(TEXT, format="flac", voice_id="default", seed=SEED)
    check_decodes_like(flac, "flac", whole_audio, streamed=False)

    async def aio() -> bytes:
        async with AsyncGatewayTTS(stack.gateway_url) as tts:
            return await tts.synthesize_file(TEXT, format="opus", voice_id="default", seed=SEED)

    check_decodes_like(asyncio.run(aio()), "opus", whole_audio, streamed=False)

    # not streamed, the gateway encodes; streamed, the CLI encodes the chunks as they come
    for extra, name, fmt, streamed in (([], "whole.mp3", "mp3", False), (["--stream"], "streamed.mp3", "mp3", True),
                                       (["--format", "aac", "--ws"], "ws.audio", "aac", True)):
        out = tmp_path / name
        assert cli_main(["synth", "--url", stack.gateway_url, "--voice", "default", "--text", "Hello there.",
                         "--seed", str(SEED), "--out", str(out), *extra]) == 0, capsys.readouterr().err
        short = pcm_f32(stack.gateway_url, "Hello there.", stream=streamed)
        check_decodes_like(out.read_bytes(), fmt, short, streamed=streamed)
    with pytest.raises(SystemExit, match="--float"):
        cli_main(["synth", "--url", stack.gateway_url, "--text", "Hi.", "--float", "--out", str(tmp_path / "a.mp3")])


# ---- speed: the served audio is the library's ------------------------------------------------------------

SHORT = "Speed changes the length, not the words."
SPEED = 1.5


@pytest.fixture(scope="module")
def library(stack):
    from web.stack import library_pipeline

    return library_pipeline(stack)


def library_audio(library, stream: bool, speed: float) -> np.ndarray:
    from cosyvoice_triton.messages import SynthesisRequest

    tts, voice = library
    request = SynthesisRequest(text=SHORT, voice=voice, seed=SEED, sampling=tts.llm.config.sampling, speed=speed)
    return np.concatenate([chunk for chunk in tts.synthesize(request, stream=stream) if chunk.size])


def test_speed_served_equals_the_library_on_every_route(stack, library, tmp_path):
    from cosyvoice_triton.client import GatewayTTS
    from cosyvoice_triton.client.cli import main as cli_main

    offline, streamed = library_audio(library, False, SPEED), library_audio(library, True, SPEED)
    assert offline.size / library_audio(library, False, 1.0).size == pytest.approx(1 / SPEED, rel=0.03)
    body = {"text": SHORT, "voice_id": "default", "seed": SEED, "format": "pcm_f32", "speed": SPEED}
    for stream, expected in ((False, offline), (True, streamed)):
        _, raw = post_tts(stack.gateway_url, {**body, "stream": stream})
        np.testing.assert_allclose(np.frombuffer(raw, "<f4"), expected, rtol=0, atol=2e-4)

    async def websocket() -> np.ndarray:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            async with http.ws_connect(stack.gateway_url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": "default", "seed": SEED, "speed": SPEED,
                                    "text": SHORT})
                await ws.send_json({"type": "end"})
                data = b""
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        data += message.data
                return np.frombuffer(data, "<f4")

    np.testing.assert_allclose(asyncio.run(websocket()), streamed, rtol=0, atol=2e-4)
    with GatewayTTS(stack.gateway_url) as tts:  # not streamed: the offline pass
        np.testing.assert_allclose(tts.synthesize(SHORT, voice_id="default", seed=SEED, speed=SPEED), offline,
                                   rtol=0, atol=2e-4)
    out = tmp_path / "fast.wav"
    assert cli_main(["synth", "--url", stack.gateway_url, "--voice", "default", "--text", SHORT, "--seed", str(SEED),
                     "--speed", str(SPEED), "--float", "--out", str(out)]) == 0
    samples, rate = sf.read(out, dtype="float32")
    np.testing.assert_allclose(samples, offline, rtol=0, atol=2e-4)
    status, raw = post_status(stack.gateway_url, {**body, "speed": 4.5})
    assert status == 400 and json.loads(raw)["error"]["param"] == "speed"


def post_status(url: str, body: dict) -> tuple[int, bytes]:
    async def post():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(url + "/v1/tts", json=body) as response:
                return response.status, await response.read()

    return asyncio.run(post())


# ---- the access log and voice registration on the same stack ----------------------------------------------

@contextmanager
def captured_access_lines():
    """The gateway's access lines while the block runs (the gateway serves from a thread of this process)."""
    from cosyvoice_triton.gateway.access_log import ACCESS_LOGGER

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def speech_wav(seed: int) -> bytes:
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    out = io.BytesIO()
    sf.write(out, speech_like(2.0, 16000, seed=seed), 16000, format="WAV", subtype="PCM_16")
    return out.getvalue()


def test_every_request_gets_one_access_line(stack, client):
    with captured_access_lines() as lines:
        client.audio.speech.create(model="tts-1", voice="default", input="Hello.", response_format="pcm",
                                   extra_body={"seed": SEED}, extra_headers={"Authorization": "Bearer sk-secret"})
        post_status(stack.gateway_url, {"text": "Hi.", "voice_id": "default", "speed": 9})
    speech, refused = lines
    match = re.fullmatch(r"access POST /v1/audio/speech 200 first_chunk_ms=(\d+) first_audible_ms=(\d+) "
                         r"audio_s=\d+\.\d\d total_ms=\d+", speech)
    assert match, speech
    assert int(match[2]) >= int(match[1])  # the random model's noise is audible from its first chunk on, not sooner
    assert float(speech.split("audio_s=")[1].split()[0]) > 0
    assert refused.startswith("access POST /v1/tts 400 first_chunk_ms=- first_audible_ms=- audio_s=-")
    assert "secret" not in speech


def register_form(url: str, audio: bytes, **fields) -> tuple[int, dict]:
    async def post():
        form = aiohttp.FormData()
        form.add_field("audio", audio, filename="prompt.wav", content_type="audio/wav")
        for key, value in fields.items():
            form.add_field(key, value)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(url + "/v1/voices", data=form) as response:
                return response.status, await response.json()

    return asyncio.run(post())


def test_registration_says_the_modes_and_a_repeat_under_another_id_is_409(stack):
    from cosyvoice_triton.client import GatewayTTS
    from cosyvoice_triton.client.common import TTSError

    url = stack.gateway_url
    recording = speech_wav(seed=21)
    status, first = register_form(url, recording, text="A prompt transcript.", id="speedy")
    assert status == 201 and first["modes"] == ["zero_shot", "cross_lingual", "instruct2", "vc"]
    status, again = register_form(url, recording, text="A prompt transcript.")
    assert status == 200 and again["id"] == "speedy" and again["created"] is False
    status, clash = register_form(url, recording, text="A prompt transcript.", id="another-id")
    assert status == 409 and clash["id"] == "speedy"
    assert clash["error"]["param"] == "id" and clash["error"]["code"] == "already_registered"

    untranscribed = speech_wav(seed=22)
    with GatewayTTS(url) as tts:  # the SDK registers too, and reads the modes
        voice = tts.add_voice(untranscribed, voice_id="no-transcript")
        assert voice.modes == ("cross_lingual", "instruct2", "vc")
        with pytest.raises(TTSError) as refused:
            tts.synthesize("Hello.", voice_id="no-transcript", seed=SEED)
        assert refused.value.status == 400 and refused.value.field == "prompt_text"
        assert "without a transcript" in str(refused.value)
        assert tts.synthesize("Hello.", voice_id="no-transcript", mode="cross_lingual", seed=SEED).size > 0
        with pytest.raises(TTSError) as conflict:
            tts.add_voice(untranscribed, voice_id="no-transcript-2")
        assert conflict.value.status == 409 and "no-transcript" in str(conflict.value)
