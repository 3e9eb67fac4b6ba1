"""True offline audio on every route: a request that is not streamed (POST /v1/tts with stream false, the OpenAI
route with stream false, the SDK's `synthesize`) is served by `cosyvoice2_offline`, one full-attention flow pass
per sentence, and equals the library's offline synthesis (`CosyVoice2.synthesize(request, stream=False)`) for
the same voice and seed. A real tritonserver on the tiny random folder and the gateway in front of it."""
from __future__ import annotations

import asyncio
import io

import aiohttp
import numpy as np
import pytest
import soundfile as sf

from web.stack import library_pipeline, serve_stack

TEXT = "Offline audio is one flow pass per sentence. A second sentence follows it."
SEED = 11
ATOL = 2e-4  # float rounding of batched flow and vocoder calls on the server
PCM16_STEP = 1 / 32768


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    with serve_stack(tmp_path_factory.mktemp("offline_routes"), tiny_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def library(stack):
    """The library's pipeline on the same folder: (CosyVoice2, the stored "default" voice)."""
    return library_pipeline(stack)


def library_audio(library, stream: bool) -> np.ndarray:
    from cosyvoice_triton.messages import SynthesisRequest

    tts, voice = library
    request = SynthesisRequest(text=TEXT, voice=voice, seed=SEED, sampling=tts.llm.config.sampling)
    return np.concatenate([chunk for chunk in tts.synthesize(request, stream=stream) if chunk.size])


def post(url: str, path: str, body: dict) -> bytes:
    async def call():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async with session.post(url + path, json=body) as response:
                assert response.status == 200, await response.text()
                return await response.read()

    return asyncio.run(call())


def test_the_library_offline_audio_differs_from_its_streamed_audio(library):
    offline, streamed = library_audio(library, stream=False), library_audio(library, stream=True)
    assert offline.size == streamed.size
    assert np.abs(offline - streamed).max() > 20 * ATOL  # chunk-masked flow: not the same audio


def test_v1_tts_not_streamed_equals_the_library_offline_audio(stack, library):
    want = library_audio(library, stream=False)
    raw = post(stack.gateway_url, "/v1/tts", {"text": TEXT, "voice_id": "default", "seed": SEED,
                                               "format": "pcm_f32", "stream": False})
    got = np.frombuffer(raw, "<f4")
    assert got.size == want.size
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_openai_route_not_streamed_equals_the_library_offline_audio(stack, library):
    want = library_audio(library, stream=False)
    wav = post(stack.gateway_url, "/v1/audio/speech", {"model": "tts-1", "voice": "default", "input": TEXT,
                                                        "response_format": "wav", "seed": SEED, "stream": False})
    got, rate = sf.read(io.BytesIO(wav), dtype="float32")
    assert rate == 24000 and got.size == want.size
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL + PCM16_STEP)


def test_sdk_synthesize_through_the_gateway_equals_the_library_offline_audio(stack, library):
    from cosyvoice_triton.client import GatewayTTS

    want = library_audio(library, stream=False)
    with GatewayTTS(stack.gateway_url) as tts:
        got = tts.synthesize(TEXT, voice_id="default", seed=SEED)
    assert got.size == want.size
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
