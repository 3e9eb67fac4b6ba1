"""Bistream text input served: a real tritonserver (tiny random folder) behind the gateway.

The text comes word by word, as an LLM agent writes it: over the WebSocket (`"text_mode": "bistream"`) and
through the SDK's gRPC form (`TritonTTS.stream_text`, and `AsyncTritonTTS.stream_text` from an async or a
plain iterable). All give the library's bistream audio for the same seed (`Pipeline.run_bistream`), and the WebSocket's first audio arrives while the first sentence is
still incomplete: the test sends its last word only after that audio has come (an order of events, no
timing). The LLM-level parts (the 5:15 plan, the scheduler) are tests/test_bistream_llm.py.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from web.stack import library_pipeline, serve_stack

pytestmark = pytest.mark.timeout(600)

SENTENCE = "Words reach the speech model one by one as an agent writes them, so it speaks early."
WORDS = [word + " " for word in SENTENCE.split(" ")[:-1]] + [SENTENCE.split(" ")[-1]]  # as a chat model streams it
SEED = 5
ATOL = 2e-4


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    with serve_stack(tmp_path_factory.mktemp("bistream"), tiny_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def library_audio(stack) -> np.ndarray:
    """The library's bistream of the same words, voice and seed (streamed, as the server streams)."""
    from cosyvoice_triton.messages import SynthesisRequest

    tts, voice = library_pipeline(stack)
    request = SynthesisRequest(text="", voice=voice, seed=SEED, sampling=tts.llm.config.sampling)
    chunks = list(tts.pipeline.run_bistream(request, iter(WORDS), stream=True))
    assert len(chunks) > 1
    return np.concatenate(chunks)


def test_the_library_speaks_the_same_however_the_text_is_cut(stack, library_audio):
    from cosyvoice_triton.messages import SynthesisRequest

    tts, voice = library_pipeline(stack)
    request = SynthesisRequest(text=SENTENCE[:7], voice=voice, seed=SEED, sampling=tts.llm.config.sampling)
    cut = [SENTENCE[7:30], "", SENTENCE[30:31], SENTENCE[31:]]  # mid-word cuts and an empty piece
    audio = np.concatenate(list(tts.pipeline.run_bistream(request, iter(cut), stream=True)))
    np.testing.assert_allclose(audio, library_audio, rtol=0, atol=ATOL)


def websocket_bistream(url: str) -> tuple[np.ndarray, list[str]]:
    """Send the sentence word by word over the WebSocket, the last word only once audio has come.
    Returns the audio and the events in order ("audio" for the first binary frame, "sent: WORD")."""
    async def session():
        events: list[str] = []
        audio: list[np.ndarray] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=500)) as http:
            async with http.ws_connect(url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": "default", "seed": SEED, "text_mode": "bistream"})
                started = await ws.receive_json()
                assert started["type"] == "started", started
                for word in WORDS[:-1]:
                    await ws.send_json({"type": "text", "text": word})
                    events.append(f"sent: {word}")
                message = await ws.receive()  # the first audio, the sentence's last word not yet sent
                assert message.type == aiohttp.WSMsgType.BINARY, message
                events.append("audio")
                audio.append(np.frombuffer(message.data, "<f4"))
                await ws.send_json({"type": "text", "text": WORDS[-1]})
                events.append(f"sent: {WORDS[-1]}")
                await ws.send_json({"type": "end"})
                while True:
                    message = await ws.receive()
                    if message.type == aiohttp.WSMsgType.BINARY:
                        audio.append(np.frombuffer(message.data, "<f4"))
                        continue
                    assert message.type == aiohttp.WSMsgType.TEXT, message
                    body = json.loads(message.data)
                    assert body["type"] in ("segment", "end"), body
                    if body["type"] == "end":
                        assert body["segments"] == 1
                        break
        return np.concatenate(audio), events

    return asyncio.run(session())


def test_websocket_bistream_speaks_before_the_first_sentence_is_complete(stack, library_audio):
    audio, events = websocket_bistream(stack.gateway_url)
    assert events.index("audio") < events.index(f"sent: {WORDS[-1]}")  # "early." (the sentence end) came later
    assert not WORDS[-2].rstrip().endswith((".", "!", "?"))  # nothing sent before it ended a sentence
    np.testing.assert_allclose(audio, library_audio, rtol=0, atol=ATOL)


def test_the_sdk_streams_text_to_triton_and_gets_the_librarys_bistream(stack, library_audio):
    from cosyvoice_triton.client import TritonTTS

    read: list[str] = []

    def words():  # an LLM agent's output, read by the SDK as the server takes it
        for word in WORDS:
            read.append(word)
            yield word

    with TritonTTS(stack.triton.grpc_url) as tts:
        with tts.stream_text(words(), voice_id="default", seed=SEED) as chunks:
            audio = np.concatenate(list(chunks))
    assert read == WORDS
    np.testing.assert_allclose(audio, library_audio, rtol=0, atol=ATOL)


def test_the_asyncio_sdk_streams_text_from_an_async_or_a_plain_iterable(stack, library_audio):
    """AsyncTritonTTS.stream_text: an agent's async token stream, and a plain list, give the blocking client's
    (and the library's) bistream audio for the same seed."""
    from cosyvoice_triton.client import AsyncTritonTTS

    read: list[str] = []

    async def words():
        for word in WORDS:
            await asyncio.sleep(0)  # an agent awaiting its model between tokens
            read.append(word)
            yield word

    async def run() -> tuple[np.ndarray, np.ndarray]:
        async with AsyncTritonTTS(stack.triton.grpc_url) as tts:
            async with tts.stream_text(words(), voice_id="default", seed=SEED) as chunks:
                from_async = np.concatenate([chunk async for chunk in chunks])
            from_list = np.concatenate([chunk async for chunk in tts.stream_text(WORDS, voice_id="default",
                                                                                 seed=SEED)])
        return from_async, from_list

    from_async, from_list = asyncio.run(run())
    assert read == WORDS
    np.testing.assert_allclose(from_async, library_audio, rtol=0, atol=ATOL)
    np.testing.assert_allclose(from_list, library_audio, rtol=0, atol=ATOL)


def test_bistream_refuses_what_it_cannot_do(stack):
    async def session(start: dict, then: dict | None = None) -> dict:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(stack.gateway_url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": "default", **start})
                answer = await ws.receive_json()
                if then is not None:
                    assert answer["type"] == "started", answer
                    await ws.send_json(then)
                    answer = await ws.receive_json()
                return answer

    error = asyncio.run(session({"text_mode": "words"}))
    assert error["type"] == "error" and error["param"] == "text_mode"
    error = asyncio.run(session({"text_mode": "bistream"}, {"type": "vc", "audio": ""}))
    assert error["type"] == "error" and error["param"] == "type" and "bistream" in error["message"]
