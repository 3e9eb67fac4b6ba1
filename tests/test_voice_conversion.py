"""Voice conversion (the official inference_vc): a source recording's speech tokens through the voice's flow
prompt and the vocoder, no LLM. The split rule of long sources (library, no server); then a real tritonserver
(tiny random folder) with the gateway in front of it: POST /v1/vc (whole and streamed), the WebSocket's vc
message, the SDKs (the gateway's, and Triton's straight to the model's vc mode) and the CLI give the library's
VC audio for the same seed and voice, and bad inputs are 4xx errors naming the field."""
from __future__ import annotations

import asyncio
import base64

import aiohttp
import numpy as np
import pytest

from web.stack import library_pipeline, serve_stack

SEED = 21
ATOL = 2e-4  # float rounding of batched flow and vocoder calls on the server


def source_recording(seconds: float = 3.0, seed: int = 7) -> bytes:
    """A speech-like source as a float WAV file (decoded exactly on both sides)."""
    from cosyvoice_triton.client.common import wav_bytes
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    return wav_bytes(speech_like(seconds, 16000, seed=seed), 16000, float32=True)


SOURCE_SECONDS = 3.0
SOURCE = source_recording(SOURCE_SECONDS)


# ---- the split rule (library) -------------------------------------------------------------------------

def test_a_short_source_is_one_piece_and_a_long_one_is_cut_in_its_pauses():
    from cosyvoice_triton.random_folder.sample_prompt import speech_like
    from cosyvoice_triton.pipeline.voice_conversion import SAMPLES_PER_TOKEN, split_source

    short = speech_like(30.0, 16000, seed=1)
    assert len(split_source(short)) == 1
    long = speech_like(70.0, 16000, seed=1)  # 3 pieces: nominal cuts at 23.33 s and 46.67 s
    long += 0.01 * np.random.default_rng(0).standard_normal(long.shape[0]).astype(np.float32)  # a noise floor
    pause = slice(int(23.6 * 16000), int(23.8 * 16000))  # a pause 0.3 s after the first nominal cut
    long[pause] = 0.0
    pieces = split_source(long)
    assert len(pieces) == 3
    assert all(piece.shape[0] <= 30 * 16000 for piece in pieces)
    np.testing.assert_array_equal(np.concatenate(pieces), long)  # in order, nothing lost
    first_cut = pieces[0].shape[0]
    assert first_cut % SAMPLES_PER_TOKEN == 0 and pause.start <= first_cut < pause.stop


def test_the_library_converts_piece_by_piece_in_order(library):
    """Each piece's audio is its own token2wav stream: a 2-piece source gives the audio of its pieces."""
    from cosyvoice_triton.messages import ConversionRequest
    from cosyvoice_triton.pipeline import voice_conversion
    from cosyvoice_triton.pipeline.seeds import sentence_seeds

    tts, voice = library
    converter = voice_conversion.local_converter(tts)
    source = np.concatenate([decoded(source_recording(1.0, seed=s))[0] for s in (1, 2)])
    split = voice_conversion.split_source
    try:  # a 1 s piece limit, for a short test of the rule's use
        voice_conversion.split_source = lambda wav: [wav[:16000], wav[16000:]]
        chunks = list(converter.run(ConversionRequest(source, 16000, voice, seed=SEED), stream=False))
    finally:
        voice_conversion.split_source = split
    assert len(chunks) == 2
    for index, (piece, chunk) in enumerate(zip((source[:16000], source[16000:]), chunks)):
        seed = sentence_seeds(SEED, index).vocoder - 1  # the piece alone: sentence 0 of a request with this seed
        alone = library_vc_samples(library, piece, 16000, seed, stream=False)
        np.testing.assert_array_equal(chunk, alone)


# ---- served -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    with serve_stack(tmp_path_factory.mktemp("voice_conversion"), tiny_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def library(stack):
    """The library's pipeline on the same folder: (CosyVoice2, the stored "default" voice)."""
    return library_pipeline(stack)


def decoded(data: bytes) -> tuple[np.ndarray, int]:
    from cosyvoice_triton.preprocess.audio import decode_audio

    return decode_audio(data, "audio")


def library_vc_samples(library, samples, rate, seed, stream, voice=None) -> np.ndarray:
    from cosyvoice_triton.messages import ConversionRequest
    from cosyvoice_triton.pipeline.voice_conversion import local_converter

    tts, default = library
    request = ConversionRequest(samples, rate, voice or default, seed=seed)
    return np.concatenate([c for c in local_converter(tts).run(request, stream=stream) if c.size])


def library_vc(library, source: bytes, stream: bool, seed: int = SEED, voice=None) -> np.ndarray:
    samples, rate = decoded(source)
    return library_vc_samples(library, samples, rate, seed, stream, voice)


def post_vc(url: str, fields: dict, files: dict) -> tuple[int, bytes]:
    async def call():
        form = aiohttp.FormData()
        for key, value in fields.items():
            form.add_field(key, value)
        for key, data in files.items():
            form.add_field(key, data, filename=f"{key}.wav", content_type="audio/wav")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async with session.post(url + "/v1/vc", data=form) as response:
                return response.status, await response.read()

    return asyncio.run(call())


@pytest.mark.parametrize("stream", [False, True])
def test_v1_vc_equals_the_library_vc(stack, library, stream):
    want = library_vc(library, SOURCE, stream)
    status, raw = post_vc(stack.gateway_url, {"voice_id": "default", "seed": str(SEED), "format": "pcm_f32",
                                              "stream": str(stream).lower()}, {"source_audio": SOURCE})
    assert status == 200, raw
    got = np.frombuffer(raw, "<f4")
    assert got.size == want.size
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    if stream:  # streamed and whole are different flow passes (chunk-masked vs full attention)
        assert np.abs(got - library_vc(library, SOURCE, stream=False)).max() > 20 * ATOL


def test_the_sdk_converts_with_a_voice_id_and_with_a_target_recording(stack, library):
    from cosyvoice_triton.client import GatewayTTS
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    tts, _ = library
    prompt = speech_like(2.5, 16000, seed=5)
    with GatewayTTS(stack.gateway_url) as client:
        whole = client.convert(SOURCE, voice_id="default", seed=SEED)
        with client.convert_stream(SOURCE, voice_id="default", seed=SEED) as chunks:
            streamed = np.concatenate(list(chunks))
        cloned = client.convert(SOURCE, prompt_audio=prompt, prompt_sample_rate=16000, seed=SEED)
    np.testing.assert_allclose(whole, library_vc(library, SOURCE, stream=False), rtol=0, atol=ATOL)
    np.testing.assert_allclose(streamed, library_vc(library, SOURCE, stream=True), rtol=0, atol=ATOL)
    target = tts.encode_voice(prompt, 16000, "")
    np.testing.assert_allclose(cloned, library_vc(library, SOURCE, stream=False, voice=target), rtol=0, atol=1e-3)


def test_the_triton_sdk_converts_as_the_gateway_does(stack, library):
    """TritonTTS / AsyncTritonTTS straight to cosyvoice2's vc mode: whole (the offline twin) and streamed, the
    source as a file or as samples, the voice as an id or a target recording: the library's VC audio."""
    from cosyvoice_triton.client import AsyncTritonTTS, TritonTTS, TTSError
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    tts, _ = library
    prompt = speech_like(2.5, 16000, seed=5)
    samples, rate = decoded(SOURCE)
    with TritonTTS(stack.triton.grpc_url) as client:
        whole = client.convert(source_audio=SOURCE, voice_id="default", seed=SEED)
        np.testing.assert_array_equal(client.convert(audio=SOURCE, voice_id="default", seed=SEED), whole)  # older name
        with client.convert_stream(samples, sample_rate=rate, voice_id="default", seed=SEED) as chunks:
            streamed = list(chunks)
        with pytest.raises(TTSError) as unknown:
            client.convert(SOURCE, voice_id="nobody")
        with pytest.raises(ValueError, match="voice"):
            client.convert(SOURCE)
        with pytest.raises(TypeError, match="instruct"):
            client.convert(SOURCE, voice_id="default", instruct="slowly")

    async def converted() -> tuple[np.ndarray, np.ndarray]:
        async with AsyncTritonTTS(stack.triton.grpc_url) as client:
            cloned = await client.convert(SOURCE, prompt_audio=prompt, prompt_sample_rate=16000, seed=SEED)
            async with client.convert_stream(SOURCE, voice_id="default", seed=SEED) as chunks:
                return cloned, np.concatenate([chunk async for chunk in chunks])

    cloned, async_streamed = asyncio.run(converted())
    np.testing.assert_allclose(whole, library_vc(library, SOURCE, stream=False), rtol=0, atol=ATOL)
    want_streamed = library_vc(library, SOURCE, stream=True)
    assert len(streamed) > 1
    np.testing.assert_allclose(np.concatenate(streamed), want_streamed, rtol=0, atol=ATOL)
    np.testing.assert_allclose(async_streamed, want_streamed, rtol=0, atol=ATOL)
    target = tts.encode_voice(prompt, 16000, "")
    np.testing.assert_allclose(cloned, library_vc(library, SOURCE, stream=False, voice=target), rtol=0, atol=1e-3)
    assert unknown.value.field == "reference_audio_id"


def test_the_websocket_speaks_a_vc_message_in_the_session_voice(stack, library):
    async def session() -> tuple[bytes, list[dict]]:
        audio, messages = b"", []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:
            async with client.ws_connect(stack.gateway_url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": "default", "seed": SEED})
                await ws.send_json({"type": "vc", "source_audio": base64.b64encode(SOURCE).decode()})
                await ws.send_json({"type": "end"})
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        audio += message.data
                    elif message.type == aiohttp.WSMsgType.TEXT:
                        messages.append(message.json())
        return audio, messages

    audio, messages = asyncio.run(session())
    assert [m["type"] for m in messages] == ["started", "segment", "end"], messages
    np.testing.assert_allclose(np.frombuffer(audio, "<f4"), library_vc(library, SOURCE, stream=True),
                               rtol=0, atol=ATOL)  # segment 0: the session's seed


def test_the_cli_converts_a_source_wav(stack, library, tmp_path):
    import soundfile as sf

    from cosyvoice_triton.client.cli import main as cli_main

    source = tmp_path / "source.wav"
    source.write_bytes(SOURCE)
    out = tmp_path / "converted.wav"
    assert cli_main(["synth", "--mode", "vc", "--source-wav", str(source), "--voice", "default", "--seed", str(SEED),
                     "--float", "--out", str(out), "--url", stack.gateway_url]) == 0
    got, rate = sf.read(out, dtype="float32")
    assert rate == 24000
    np.testing.assert_allclose(got, library_vc(library, SOURCE, stream=False), rtol=0, atol=ATOL)


@pytest.mark.parametrize("fields, files, status, field", [
    ({"voice_id": "default"}, {}, 400, "source_audio"),
    ({"voice_id": "default"}, {"source_audio": b"RIFF not audio at all"}, 400, "source_audio"),
    ({"voice_id": "default"}, {"audio": b"RIFF not audio at all"}, 400, "audio"),
    ({"voice_id": "default"}, {"audio": source_recording(0.1)}, 400, "audio"),
    ({"voice_id": "default"}, {"audio": SOURCE, "prompt_audio": SOURCE}, 400, "voice_id"),
    ({"voice_id": "nobody"}, {"audio": SOURCE}, 404, "voice_id"),
    ({}, {"audio": SOURCE, "prompt_audio": b"garbage"}, 400, "prompt_audio"),
    ({"seed": "x"}, {"audio": SOURCE}, 400, "seed"),
    ({"seed": "-1"}, {"audio": SOURCE}, 400, "seed"),
    ({"stream": "maybe"}, {"audio": SOURCE}, 400, "stream"),
    ({"format": "midi"}, {"audio": SOURCE}, 400, "format"),
    ({"text": "hello"}, {"audio": SOURCE}, 400, "text"),
])
def test_bad_inputs_are_4xx_naming_the_field(stack, fields, files, status, field):
    got, raw = post_vc(stack.gateway_url, fields, files)
    assert got == status, raw
    assert field in raw.decode()


def test_a_json_body_and_a_bad_vc_message_are_refused_naming_the_field(stack):
    async def calls() -> tuple[int, str, dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.post(stack.gateway_url + "/v1/vc", json={"audio": "x"}) as response:
                status, body = response.status, await response.text()
            async with session.ws_connect(stack.gateway_url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": "default"})
                await ws.receive_json()  # started
                await ws.send_json({"type": "vc", "audio": "not base64!"})
                return status, body, await ws.receive_json()

    status, body, message = asyncio.run(calls())
    assert status == 400 and "body" in body
    assert message["type"] == "error" and message["param"] == "audio"


def test_triton_refuses_a_vc_request_with_text_or_without_a_source(stack):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    from cosyvoice_triton.wire.names import SOURCE_AUDIO, TARGET_TEXT
    from cosyvoice_triton.wire.requests import ConversionInputs, PromptAudio
    from cosyvoice_triton.wire.tensors import string_array

    client = grpcclient.InferenceServerClient(stack.triton.grpc_url.removeprefix("grpc://"))

    def infer(values: dict) -> str:
        inputs = []
        for name, array in values.items():
            kind = "BYTES" if array.dtype == object else np_to_triton_dtype(array.dtype)
            tensor = grpcclient.InferInput(name, list(array.shape), kind)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        with pytest.raises(Exception) as error:
            client.infer("cosyvoice2_offline", inputs)
        return str(error.value)

    conversion = ConversionInputs(PromptAudio(file_bytes=SOURCE), voice_id="default").tensors()
    assert "target_text" in infer({**conversion, TARGET_TEXT: string_array("Hi.")})
    assert "source_audio" in infer({name: value for name, value in conversion.items() if name != SOURCE_AUDIO})
    client.close()


def test_a_long_source_is_split_and_spoken_in_order_as_the_library_does(stack, library):
    """31 s: two pieces (the S3 tokenizer takes at most 30 s), one offline flow pass each, in order."""
    from cosyvoice_triton.client import GatewayTTS
    from cosyvoice_triton.pipeline.voice_conversion import split_source

    source = source_recording(31.0, seed=3)
    assert len(split_source(decoded(source)[0])) == 2
    with GatewayTTS(stack.gateway_url) as client:
        got = client.convert(source, voice_id="default", seed=SEED)
    want = library_vc(library, source, stream=False)
    assert got.size == want.size == 31 * 24000
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_the_library_vc_takes_a_speed_as_the_official_inference_vc(library):
    from cosyvoice_triton.messages import ConversionRequest
    from cosyvoice_triton.pipeline.voice_conversion import local_converter

    tts, voice = library
    samples, rate = decoded(SOURCE)
    faster = np.concatenate(list(local_converter(tts).run(ConversionRequest(samples, rate, voice, seed=SEED,
                                                                            speed=1.5), stream=False)))
    assert faster.size == int(SOURCE_SECONDS * 50 / 1.5) * 480  # mel frames / speed, 480 samples each
    with pytest.raises(ValueError, match="speed"):
        ConversionRequest(samples, rate, voice, speed=5.0).validate()


def test_v1_vc_takes_a_speed_and_refuses_one_out_of_range(stack, library):
    from cosyvoice_triton.messages import ConversionRequest
    from cosyvoice_triton.pipeline.voice_conversion import local_converter

    tts, voice = library
    samples, rate = decoded(SOURCE)
    request = ConversionRequest(samples, rate, voice, seed=SEED, speed=1.5)
    want = np.concatenate(list(local_converter(tts).run(request, stream=False)))
    status, raw = post_vc(stack.gateway_url, {"seed": str(SEED), "speed": "1.5", "format": "pcm_f32"},
                          {"audio": SOURCE})
    assert status == 200, raw
    np.testing.assert_allclose(np.frombuffer(raw, "<f4"), want, rtol=0, atol=ATOL)
    for bad in ("5", "fast"):
        status, raw = post_vc(stack.gateway_url, {"speed": bad}, {"audio": SOURCE})
        assert status == 400 and b"speed" in raw
