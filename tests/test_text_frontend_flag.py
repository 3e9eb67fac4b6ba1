"""`text_frontend: false` per request (the official flag): the text is spoken as given, without normalization or
sentence splitting. Library: the LLM gets the raw text's token ids (digits stay digits). A real tritonserver
(tiny random folder) behind the gateway: /v1/tts and the SDK with the flag equal the library's offline audio
with it, and differ from the normalized path; a value that is not a boolean is a 400 on /v1/tts and an error
on the WebSocket."""
from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from web.stack import library_pipeline, serve_stack

TEXT = "I have 3 cats and 25 dogs. They eat at 7 pm."
SEED = 3
ATOL = 2e-4


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    with serve_stack(tmp_path_factory.mktemp("text_frontend"), tiny_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def library(stack):
    """The library's pipeline on the same folder: (CosyVoice2, the stored "default" voice)."""
    return library_pipeline(stack)


def request(library, text_frontend: bool):
    from cosyvoice_triton.messages import SynthesisRequest

    tts, voice = library
    return SynthesisRequest(text=TEXT, voice=voice, seed=SEED, sampling=tts.llm.config.sampling,
                            text_frontend=text_frontend)


def library_audio(library, text_frontend: bool) -> np.ndarray:
    chunks = library[0].synthesize(request(library, text_frontend), stream=False)
    return np.concatenate([chunk for chunk in chunks if chunk.size])


def post_tts(url: str, body: dict) -> tuple[int, bytes]:
    async def call():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async with session.post(url + "/v1/tts", json=body) as response:
                return response.status, await response.read()

    return asyncio.run(call())


def test_the_llm_gets_the_text_as_given(library):
    tts, voice = library
    encode = tts.preprocessor.tokenizer.encode
    raw = tts.pipeline.llm_requests(request(library, False), "r", SEED)
    normalized = tts.pipeline.llm_requests(request(library, True), "r", SEED)
    assert [r.text_tokens for r in raw] == [encode(TEXT)]  # one piece, digits and all
    assert [r.text_tokens for r in normalized] != [r.text_tokens for r in raw]
    assert "three" in tts.preprocessor.tokenizer.decode(normalized[0].text_tokens)
    assert raw[0].prompt_text_tokens == encode(voice.text)  # the prompt transcript as given too


def test_v1_tts_and_the_sdk_speak_the_text_as_given(stack, library):
    from cosyvoice_triton.client import GatewayTTS

    want = library_audio(library, text_frontend=False)
    status, raw = post_tts(stack.gateway_url, {"text": TEXT, "voice_id": "default", "seed": SEED,
                                               "format": "pcm_f32", "text_frontend": False})
    assert status == 200, raw
    got = np.frombuffer(raw, "<f4")
    assert got.size == want.size
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    normalized = library_audio(library, text_frontend=True)
    assert normalized.size != want.size or np.abs(normalized - want).max() > 20 * ATOL
    with GatewayTTS(stack.gateway_url) as tts:
        sdk = tts.synthesize(TEXT, voice_id="default", seed=SEED, text_frontend=False)
    np.testing.assert_allclose(sdk, want, rtol=0, atol=ATOL)


def test_a_flag_that_is_not_a_boolean_is_refused(stack):
    status, body = post_tts(stack.gateway_url, {"text": TEXT, "text_frontend": "no"})
    assert status == 400 and b"text_frontend" in body

    async def websocket() -> dict:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.ws_connect(stack.gateway_url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": "default", "text_frontend": 1})
                return await ws.receive_json()

    message = asyncio.run(websocket())
    assert message["type"] == "error" and "text_frontend" in str(message)
