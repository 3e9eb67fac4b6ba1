"""CosyVoice3 on a real tritonserver: a tiny random CosyVoice3 folder served as `cosyvoice-triton serve` serves it.

One server for the module (on free ports, max_token_text_ratio 3 to keep outputs short) and a gateway in this
process in front of it. The server names its synthesis models for the family (cosyvoice3, cosyvoice3_offline)
and the gateway names the family on /readyz and /v1/models. Every mode streams audio through the Python SDK
equal to the in-process `CosyVoice.from_model_dir` on the same folder with the same seed (streamed and offline,
voice conversion too), and /v1/tts streams the server's own audio for the default voice and an uploaded prompt.
Every route speaks the in-process audio with a voice registered through the gateway: the WebSocket in sentence
mode and with bistream text (and the Triton SDK's bistream), the official `openai` client (instructions: instruct2),
SSML breaks and rates with speech marks streamed, /v1/tts with cross_lingual, instruct2 and speed, /v1/vc through
both gateway SDKs (and /v1/tts through the asyncio one), a saved speaker imported from spk2info.pt; the web page
in Chromium names the family and streams the WebSocket's audio.
The official Triton clients' requests (`--model-name cosyvoice3`) get the in-process audio too, straight to
cosyvoice3_official / cosyvoice3_official_offline and through the gateway's Triton facade and KServe route.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import requests
import soundfile as sf

from cosyvoice_triton.audio_out import encode
from cosyvoice_triton.client.gateway_client import GatewayTTS
from cosyvoice_triton.client.triton_client import TritonTTS
from cosyvoice_triton.gateway.config import GatewayConfig, RoutingConfig, family_models
from cosyvoice_triton.gateway.testing import GatewayThread
from cosyvoice_triton.gateway.triton_facade import OFFICIAL_TRITON_PORT
from cosyvoice_triton.errors import from_wire
from cosyvoice_triton.messages import ConversionRequest, SynthesisRequest
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.server.templates import model_names
from cosyvoice_triton.wire.names import (COSYVOICE2, COSYVOICE3, COSYVOICE3_OFFICIAL, COSYVOICE3_OFFICIAL_OFFLINE,
                                         COSYVOICE3_OFFLINE, FAMILY_MODELS, WAVEFORM)
from test_official_facade import infer as official_infer, kserve_body, stream as official_stream
from test_official_triton import official_inputs
from triton_harness import tritonserver_or_skip

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

RATIO = 3.0
RATE = 16000
PROMPT_TEXT = "a short voice prompt"
TEXT = "Hello there, this is a short reply. And a second sentence follows it."
SEED = 10  # every mode speaks more than one chunk of TEXT at this seed (the random LLM may stop any sentence early)
ATOL = 2e-4  # as the CosyVoice2 served-vs-in-process tests: batched flow and vocoder calls may round differently
PROMPT = speech_like(2.0, RATE, seed=3, pitch_hz=110.0)
SOURCE = speech_like(1.5, RATE, seed=11, pitch_hz=140.0)
MODES = {"zero_shot": {}, "cross_lingual": {"mode": "cross_lingual"},
         "instruct2": {"mode": "instruct2", "instruct": "Speak slowly."}}


# ---- fixtures -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cv3_dir(tmp_path_factory) -> Path:
    from cosyvoice_triton.random_folder.write import write_random_model

    return write_random_model(tmp_path_factory.mktemp("cv3") / "model", size="tiny", seed=0, family="cosyvoice3")


@pytest.fixture(scope="module")
def server(cv3_dir, tmp_path_factory):
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    binary = tritonserver_or_skip()
    run_dir = tmp_path_factory.mktemp("cv3-serve")
    options = ServeOptions(model_dir=cv3_dir, run_dir=run_dir, address="127.0.0.1", http_port=None, grpc_port=None,
                           metrics_port=None, voice_store=str(run_dir / "voices.sqlite"), max_token_text_ratio=RATIO,
                           torch_threads=1, workers=4, official_models=True)
    server = prepare(options, binary=binary, die_with_parent=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sdk(server):
    with TritonTTS(f"127.0.0.1:{server.grpc_port}", model=COSYVOICE3, offline_model=COSYVOICE3_OFFLINE,
                   timeout_s=120) as client:
        yield client


@pytest.fixture(scope="module")
def gateway(server, cv3_dir, tmp_path_factory):
    synthesis_model, offline_model = family_models(cv3_dir)
    config = GatewayConfig(triton=(server.target,), voice_store=str(server.workdir / "voices.sqlite"),
                           model_dir=cv3_dir, home=tmp_path_factory.mktemp("home"),
                           routing=RoutingConfig(health_interval_s=1.0, metrics_interval_s=1.0),
                           synthesis_model=synthesis_model, offline_model=offline_model, official_triton_port=0)
    with GatewayThread(config) as gw:
        gw.wait_ready()
        yield gw


class InProcess:
    """`CosyVoice.from_model_dir` on the same folder, one request at a time."""

    def __init__(self, model_dir: Path):
        from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice

        self.tts = CosyVoice.from_model_dir(model_dir)
        self.tts.llm.config.max_token_text_ratio = RATIO
        self.voice = self.tts.encode_voice(PROMPT, RATE, PROMPT_TEXT)
        self.lock = threading.Lock()

    def synthesize(self, stream: bool, mode: str = "zero_shot", instruct: str = "") -> list[np.ndarray]:
        return self.run(stream, mode=mode, instruct_text=instruct)

    def run(self, stream: bool, text: str = TEXT, seed: int = SEED, voice=None, **fields) -> list:
        """One request's items: its audio chunks (and its speech mark events with marks=True)."""
        request = SynthesisRequest(text=text, voice=voice or self.voice, seed=seed,
                                   sampling=self.tts.llm.config.sampling, **fields)
        with self.lock:
            return [item for item in self.tts.synthesize(request, stream=stream)
                    if not isinstance(item, np.ndarray) or item.size]

    def bistream(self, words: list[str]) -> np.ndarray:
        """The text given word by word to one synthesis (streamed), as a served bistream request."""
        request = SynthesisRequest(text="", voice=self.voice, seed=SEED, sampling=self.tts.llm.config.sampling)
        with self.lock:
            return joined([c for c in self.tts.pipeline.run_bistream(request, iter(words), stream=True) if c.size])

    def convert(self, stream: bool) -> list[np.ndarray]:
        from cosyvoice_triton.pipeline.voice_conversion import local_converter

        with self.lock:
            run = local_converter(self.tts).run(ConversionRequest(SOURCE, RATE, self.voice, seed=SEED), stream=stream)
            return [chunk for chunk in run if chunk.size]


@pytest.fixture(scope="module")
def in_process(cv3_dir) -> InProcess:
    return InProcess(cv3_dir)


def joined(chunks) -> np.ndarray:
    return np.concatenate(list(chunks)) if chunks else np.zeros(0, np.float32)


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert want.size > 0 and got.size == want.size
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def to_s16(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer(encode(samples, "pcm"), "<i2").astype(np.int32)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


# ---- the family's names -----------------------------------------------------------------------------------

def test_the_server_serves_the_synthesis_models_named_for_the_family(server):
    names = model_names(server.model_repository)
    assert {*FAMILY_MODELS["cosyvoice3"], "llm", "token2wav", "prompt_encoder", "register_voice"} <= set(names)
    assert not set(FAMILY_MODELS["cosyvoice2"]) & set(names)  # CosyVoice2's names, its official form's too
    for model in FAMILY_MODELS["cosyvoice3"]:  # cosyvoice3, cosyvoice3_offline, cosyvoice3_official(_offline)
        assert get_json(f"http://127.0.0.1:{server.http_port}/v2/models/{model}")["name"] == model
        config = get_json(f"http://127.0.0.1:{server.http_port}/v2/models/{model}/config")
        assert config["parameters"]["family"]["string_value"] == "cosyvoice3"
    config = get_json(f"http://127.0.0.1:{server.http_port}/v2/models/token2wav/config")
    assert config["parameters"]["flow_cache_frames"]["string_value"] == ""  # the family's own default (300)


def test_readyz_and_v1_models_name_the_family(gateway):
    status, ready = gateway.get_json("/readyz")
    assert status == 200 and ready["family"] == "cosyvoice3"
    status, models = gateway.get_json("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [COSYVOICE3]


# ---- served equals in-process ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_streams_the_in_process_audio(sdk, in_process, mode):
    options = MODES[mode]
    with sdk.stream(TEXT, prompt_audio=PROMPT, prompt_sample_rate=RATE, prompt_text=PROMPT_TEXT, seed=SEED,
                    **options) as chunks:
        streamed = [c for c in chunks if c.size]
    want = in_process.synthesize(True, options.get("mode", "zero_shot"), options.get("instruct", ""))
    assert len(want) >= 2  # streamed: the chunk schedule ran, not one chunk per sentence
    assert len(streamed) == len(want) and [c.size for c in streamed] == [c.size for c in want]
    assert_same_audio(joined(streamed), joined(want))
    offline = sdk.synthesize(TEXT, offline=True, prompt_audio=PROMPT, prompt_sample_rate=RATE,
                             prompt_text=PROMPT_TEXT, seed=SEED, **options)
    assert_same_audio(offline, joined(in_process.synthesize(False, options.get("mode", "zero_shot"),
                                                            options.get("instruct", ""))))


def test_the_same_seed_gives_the_same_audio(sdk):
    def audio(seed: int) -> np.ndarray:
        return sdk.synthesize(TEXT, prompt_audio=PROMPT, prompt_sample_rate=RATE, prompt_text=PROMPT_TEXT, seed=seed)

    first = audio(SEED)
    assert first.size > 0
    np.testing.assert_array_equal(audio(SEED), first)


def test_voice_conversion_streams_the_in_process_audio(sdk, in_process):
    with sdk.convert_stream(SOURCE, sample_rate=RATE, prompt_audio=PROMPT, prompt_sample_rate=RATE,
                            seed=SEED) as chunks:
        streamed = joined([c for c in chunks if c.size])
    assert_same_audio(streamed, joined(in_process.convert(True)))
    offline = sdk.convert(SOURCE, sample_rate=RATE, prompt_audio=PROMPT, prompt_sample_rate=RATE, seed=SEED)
    assert_same_audio(offline, joined(in_process.convert(False)))


# ---- the gateway --------------------------------------------------------------------------------------------

def prompt_file() -> bytes:
    out = io.BytesIO()
    sf.write(out, PROMPT, RATE, format="WAV", subtype="FLOAT")
    return out.getvalue()


async def tts_pcm(url: str, body: dict) -> np.ndarray:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(url + "/v1/tts", json={**body, "format": "pcm", "seed": SEED}) as response:
            data = await response.read()
            assert response.status == 200, data[:300]
    return np.frombuffer(data, "<i2").astype(np.int32)


@pytest.mark.parametrize("voice", ["default", "uploaded"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_v1_tts_gives_the_servers_audio(gateway, sdk, voice, stream):
    if voice == "default":
        body, direct = {"voice_id": "default"}, {"voice_id": "default"}
    else:
        body = {"prompt_audio": base64.b64encode(prompt_file()).decode(), "prompt_text": PROMPT_TEXT}
        direct = {"prompt_audio": PROMPT, "prompt_sample_rate": RATE, "prompt_text": PROMPT_TEXT}
    got = asyncio.run(tts_pcm(gateway.url, {"text": TEXT, "stream": stream, **body}))
    # not streamed: the gateway asks the offline model, one full-attention flow pass per sentence
    want = to_s16(sdk.synthesize(TEXT, offline=not stream, seed=SEED, **direct))
    assert want.size > 0 and got.size == want.size
    assert np.abs(got - want).max() <= 8  # 16-bit samples, ATOL of the float audio


# ---- every route, every mode -----------------------------------------------------------------------------
# The voice of PROMPT and PROMPT_TEXT, registered once through the gateway (the server encodes it with the
# CosyVoice3 folder's tokenizer v3, mel and CAM++), speaks on each route what the in-process pipeline says with
# the same recording, text and seed.

VOICE = "cv3_prompt"
WORDS = [word + " " for word in TEXT.split(" ")[:-1]] + [TEXT.split(" ")[-1]]  # as a chat model streams it
SSML = '<speak>Hello there.<break time="300ms"/><prosody rate="50%">Good morning.</prosody></speak>'


@pytest.fixture(scope="module")
def voice(gateway) -> str:
    with GatewayTTS(gateway.url, timeout_s=120) as tts:
        assert tts.add_voice(prompt_file(), PROMPT_TEXT, voice_id=VOICE).voice_id == VOICE
    return VOICE


def test_the_websocket_speaks_each_sentence_as_it_completes(gateway, in_process, voice):
    """Sentence mode: text in pieces, one segment (one request, seed + 1000 each) per complete sentence."""
    pieces = ["Hello there, this is ", "a short reply. And a second ", "sentence follows it."]
    with GatewayTTS(gateway.url, timeout_s=120) as tts:
        with tts.stream_ws(iter(pieces), voice_id=voice, seed=SEED, model=COSYVOICE3) as chunks:
            got = joined([c for c in chunks if c.size])
    segments = [s["text"] for s in chunks.stats.segments]
    assert segments == ["Hello there, this is a short reply. ", "And a second sentence follows it."]
    want = [joined(in_process.run(True, text, SEED + 1000 * i)) for i, text in enumerate(segments)]
    assert chunks.stats.end["audio_seconds"] == pytest.approx(got.size / 24000)
    assert_same_audio(got, joined(want))


def test_bistream_text_over_the_websocket_and_the_triton_sdk(gateway, sdk, in_process, voice):
    """CosyVoice3's LM reads text as it comes (its 5:15 text/speech plan): word by word over the WebSocket
    and the Triton SDK's gRPC form, the in-process bistream audio of the same words and seed."""
    want = in_process.bistream(WORDS)

    async def websocket() -> tuple[dict, np.ndarray]:
        audio = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            async with http.ws_connect(gateway.url + "/v1/tts/ws") as ws:
                await ws.send_json({"type": "start", "voice_id": voice, "seed": SEED, "text_mode": "bistream",
                                    "model": COSYVOICE3})
                started = await ws.receive_json()
                for word in WORDS:
                    await ws.send_json({"type": "text", "text": word})
                await ws.send_json({"type": "end"})
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        audio.append(np.frombuffer(message.data, "<f4"))
                    elif message.json()["type"] in ("end", "error"):
                        assert message.json()["type"] == "end", message.data
                        break
        return started, joined(audio)

    started, got = asyncio.run(websocket())
    assert (started["type"], started["model"]) == ("started", COSYVOICE3)
    assert_same_audio(got, want)
    with sdk.stream_text(iter(WORDS), voice_id=voice, seed=SEED) as chunks:  # straight to cosyvoice3
        assert_same_audio(joined([c for c in chunks if c.size]), want)


def test_the_official_openai_client_speaks_with_cosyvoice3(gateway, in_process, voice):
    """`model` cosyvoice3, and tts-1 (the default family: the servers' one) with `instructions` (instruct2)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    for model, extra, want in (
            (COSYVOICE3, {}, in_process.synthesize(True)),
            ("tts-1", {"instructions": "Speak slowly."}, in_process.synthesize(True, "instruct2", "Speak slowly."))):
        pcm = client.audio.speech.create(model=model, voice=voice, input=TEXT, response_format="pcm",
                                         extra_body={"seed": SEED}, **extra).content
        got = np.frombuffer(pcm, "<i2").astype(np.int32)
        assert got.size == to_s16(joined(want)).size and np.abs(got - to_s16(joined(want))).max() <= 8


def test_ssml_breaks_and_rates_stream_with_speech_marks(gateway, in_process, voice):
    """A <break> and a <prosody rate> on a streamed route (/v1/tts as server-sent events): the in-process
    audio and marks, each mark at the audio sent before it, the break exact silence, the slow sentence the
    in-process one at speed 0.5 (its seeds those of the document's second sentence)."""
    from cosyvoice_triton.pipeline.seeds import sentence_seeds
    from cosyvoice_triton.pipeline.speech_marks import complete_marks
    from test_speech_marks import Received, check_tiling

    received = Received()
    with GatewayTTS(gateway.url, timeout_s=120) as tts:
        with tts.stream(SSML, voice_id=voice, seed=SEED, marks=True, model=COSYVOICE3) as chunks:
            for chunk in chunks:
                for event in chunk.marks:
                    received.event(event)
                received.chunk(chunk)
    received.close(chunks.marks)
    marks = received.marks
    assert [(m["type"], m["value"]) for m in marks] == [("sentence", "Hello there."), ("break", "300ms"),
                                                          ("sentence", "Good morning.")]
    check_tiling(marks, received.samples)
    items = in_process.run(True, SSML, marks=True)
    assert marks == complete_marks(item.to_json() for item in items if not isinstance(item, np.ndarray))
    assert_same_audio(received.waveform, joined([i for i in items if isinstance(i, np.ndarray)]))
    first, pause, slow = ((int(m["start_ms"] * 24), int(m["end_ms"] * 24)) for m in marks)
    assert pause[1] - pause[0] == 7200 and not received.waveform[pause[0]:pause[1]].any()
    want_slow = joined(in_process.run(True, "Good morning.", sentence_seeds(SEED, 1).llm, speed=0.5))
    assert_same_audio(received.waveform[slow[0]:slow[1]], want_slow)


@pytest.mark.parametrize("mode, fields, stream", [
    ("cross_lingual", {"speed": 1.25}, True),
    ("instruct2", {"instruct": "Speak slowly.", "speed": 0.8}, False)], ids=["cross_lingual", "instruct2"])
def test_v1_tts_takes_the_mode_instruction_and_speed(gateway, in_process, voice, mode, fields, stream):
    body = {"text": TEXT, "voice_id": voice, "mode": mode, "model": COSYVOICE3, "stream": stream,
            "format": "pcm_f32", "seed": SEED, **fields}
    answer = requests.post(gateway.url + "/v1/tts", json=body, timeout=120)
    assert answer.status_code == 200, answer.text[:300]
    library = {"instruct_text" if k == "instruct" else k: v for k, v in fields.items()}
    want = joined(in_process.run(stream, mode=mode, **library))
    assert_same_audio(np.frombuffer(answer.content, "<f4"), want)
    plain = joined(in_process.run(stream, mode=mode, **{**library, "speed": 1.0}))
    assert abs(plain.size / want.size - fields["speed"]) < 0.05  # the speed was applied, not dropped


def test_voice_conversion_through_the_gateway_and_both_gateway_sdks(gateway, in_process, voice):
    """POST /v1/vc whole (the blocking SDK) and streamed (the asyncio SDK), and the asyncio SDK's /v1/tts stream."""
    from cosyvoice_triton.client import AsyncGatewayTTS

    with GatewayTTS(gateway.url, timeout_s=120) as tts:
        whole = tts.convert(SOURCE, sample_rate=RATE, voice_id=voice, seed=SEED, model=COSYVOICE3)
    assert_same_audio(whole, joined(in_process.convert(False)))

    async def run() -> tuple[np.ndarray, list[np.ndarray]]:
        async with AsyncGatewayTTS(gateway.url, timeout_s=120) as tts:
            async with await tts.convert_stream(SOURCE, sample_rate=RATE, voice_id=voice, seed=SEED,
                                                model=COSYVOICE3) as chunks:
                converted = joined([c async for c in chunks if c.size])
            async with await tts.stream(TEXT, voice_id=voice, seed=SEED, model=COSYVOICE3) as chunks:
                spoken = [c async for c in chunks if c.size]
        return converted, spoken

    converted, spoken = asyncio.run(run())
    assert_same_audio(converted, joined(in_process.convert(True)))
    assert_same_audio(joined(spoken), joined(in_process.synthesize(True)))


def test_a_saved_speaker_speaks_through_the_gateway(gateway, server, cv3_dir, in_process, tmp_path):
    """spk2info.pt as the official CosyVoice3 `add_zero_shot_spk` saves it (its prompt text in the official
    form, <|endofprompt|> included), imported into the served voice store: /v1/tts speaks with it what the
    in-process pipeline says with the stored features."""
    import torch

    from cosyvoice_triton.cli import main
    from cosyvoice_triton.family import COSYVOICE3 as FAMILY
    from cosyvoice_triton.voices.stores import open_voice_store

    store_path = str(server.workdir / "voices.sqlite")
    saved = in_process.tts.preprocessor.tokenizer.encode(FAMILY.prompt_prefix + PROMPT_TEXT)
    rng = torch.Generator().manual_seed(0)
    speech = torch.randint(0, 6561, (1, 40), generator=rng, dtype=torch.int32)
    embedding = torch.randn(1, 192, generator=rng)
    entry = {"prompt_text": torch.tensor([saved], dtype=torch.int32), "llm_prompt_speech_token": speech,
             "flow_prompt_speech_token": speech, "prompt_speech_feat": torch.randn(1, 80, 80, generator=rng) - 4.0,
             "llm_embedding": embedding, "flow_embedding": embedding}
    entry.update({f"{k}_len": torch.tensor([entry[k].shape[1]], dtype=torch.int32)
                  for k in ("prompt_text", "llm_prompt_speech_token", "flow_prompt_speech_token",
                            "prompt_speech_feat")})
    torch.save({"cv3_saved": entry}, tmp_path / "spk2info.pt")
    assert main(["voices", "import", str(tmp_path / "spk2info.pt"), "--model-dir", str(cv3_dir),
                 "--voice-store", store_path]) == 0
    answer = requests.post(gateway.url + "/v1/tts", json={"text": TEXT, "voice_id": "cv3_saved", "seed": SEED,
                                                          "format": "pcm_f32"}, timeout=120)
    assert answer.status_code == 200, answer.text[:300]
    store = open_voice_store(store_path)
    try:
        stored = store.get("cv3_saved", family="cosyvoice3")
    finally:
        store.close()
    np.testing.assert_array_equal(stored.speech_tokens, speech[0].numpy())
    assert_same_audio(np.frombuffer(answer.content, "<f4"), joined(in_process.run(False, voice=stored)))


def test_the_web_page_speaks_with_cosyvoice3(gateway, tmp_path):
    """The page in Chromium (tests/test_web_page.py drives every control on a CosyVoice2 stack): on a
    CosyVoice3 gateway it names the family, shows no model picker (one family served), and the default voice
    streams through Web Audio the audio the WebSocket gives the SDK for the same text and seed."""
    from test_web_page import page_at, speak

    with page_at(gateway.url, tmp_path / "profile") as page:
        page.wait_for("!!document.querySelector('#voice option[value=\"default\"]')", 30)
        assert page.text("#family-name") == "CosyVoice3"
        assert page.evaluate("document.querySelector('#model-field').hidden")
        page.fill("#seed", str(SEED))
        assert speak(page, TEXT) == "done", page.text("#speak-error")
        assert page.text("#used-model") == COSYVOICE3 and int(page.text("#chunks")) >= 2
        played = page.evaluate("(() => { const a = state.player.all(); "
                               "return [a.length, a.reduce((sum, x) => sum + x * x, 0)]; })()")
    with GatewayTTS(gateway.url, timeout_s=120) as tts:
        with tts.stream_ws(TEXT, voice_id="default", seed=SEED) as chunks:
            want = joined([c for c in chunks if c.size])
    assert played[0] == want.size > 0 and played[1] == pytest.approx(float(np.sum(want.astype(np.float64) ** 2)))


# ---- the official Triton clients --------------------------------------------------------------------------
# runtime/triton_trtllm's client_grpc.py (--mode streaming / offline) and client_http.py with --model-name
# cosyvoice3 send what they send for cosyvoice2: reference_wav FP32 [1, N] at 16 kHz, zero-padded (client_grpc: to
# whole 10 s streamed, whole seconds offline; client_http: not), reference_wav_len INT32 [1, 1], reference_text and
# target_text BYTES [1, 1] (tests/test_official_triton.py `official_inputs`). Here with our `seed` [1, 1] as well,
# so that their audio can equal the in-process pipeline's for the same prompt, text and seed.

def official(padded_s: int | None = None) -> dict:
    return official_inputs(TEXT, PROMPT, PROMPT_TEXT, padded_to=padded_s * RATE if padded_s else None, seed=SEED)


@pytest.fixture(scope="module")
def in_process_zero_shot(in_process) -> tuple[list[np.ndarray], np.ndarray]:
    """The in-process zero_shot audio for PROMPT, PROMPT_TEXT, TEXT and SEED: (streamed chunks, offline)."""
    streamed = in_process.synthesize(True)
    assert len(streamed) >= 2  # the chunk schedule ran
    return streamed, joined(in_process.synthesize(False))


def assert_official_stream(chunks: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert all(c.ndim == 2 and c.shape[0] == 1 for c in chunks)  # [1, n] each, as the official's
    assert [c.size for c in chunks] == [c.size for c in want]
    assert_same_audio(joined([c.reshape(-1) for c in chunks]), joined(want))


def assert_official_whole(waveform: np.ndarray, want: np.ndarray) -> None:
    assert waveform.shape == (1, want.size)
    assert_same_audio(waveform.reshape(-1), want)


def kserve_waveform(answer: requests.Response) -> np.ndarray:
    """client_http.py's reading of the answer: outputs[0]'s data, here with its name and shape checked."""
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    assert (output["name"], output["datatype"]) == (WAVEFORM, "FP32")
    return np.array(output["data"], np.float32).reshape(output["shape"])


def test_the_official_form_straight_to_triton_gives_the_in_process_audio(server, in_process_zero_shot):
    want_streamed, want_whole = in_process_zero_shot
    assert_official_stream(official_stream(server.grpc_url, COSYVOICE3_OFFICIAL, official(10)), want_streamed)
    result = official_infer(server.grpc_url, COSYVOICE3_OFFICIAL_OFFLINE, official(5))
    assert_official_whole(result.as_numpy(WAVEFORM), want_whole)
    answer = requests.post(f"http://127.0.0.1:{server.http_port}/v2/models/{COSYVOICE3_OFFICIAL_OFFLINE}/infer",
                           json=kserve_body(official()), params={"request_id": "0"}, timeout=180)
    assert_official_whole(kserve_waveform(answer), want_whole)


def test_the_official_clients_through_the_gateway_give_the_in_process_audio(gateway, in_process_zero_shot):
    want_streamed, want_whole = in_process_zero_shot
    facade = f"127.0.0.1:{gateway.call(lambda app: app[OFFICIAL_TRITON_PORT])}"
    assert_official_stream(official_stream(facade, COSYVOICE3, official(10)), want_streamed)  # -> cosyvoice3_official
    result = official_infer(facade, COSYVOICE3, official(5))  # -> cosyvoice3_official_offline
    assert result.get_response().model_name == COSYVOICE3  # answered under the name the client asked for
    assert_official_whole(result.as_numpy(WAVEFORM), want_whole)
    answer = requests.post(f"{gateway.url}/v2/models/{COSYVOICE3}/infer", json=kserve_body(official()),
                           params={"request_id": "0"}, timeout=180)
    assert answer.json()["model_name"] == COSYVOICE3
    assert_official_whole(kserve_waveform(answer), want_whole)
    # A CosyVoice3 gateway answers KServe inference for its own family's names, and names the field otherwise.
    other = requests.post(f"{gateway.url}/v2/models/{COSYVOICE2}/infer", json=kserve_body(official()), timeout=30)
    assert other.status_code == 404 and from_wire(other.json()["error"]).field == "model_name"


def test_the_spk2info_form_through_the_gateway_speaks_in_the_default_voice(gateway, sdk):
    facade = f"127.0.0.1:{gateway.call(lambda app: app[OFFICIAL_TRITON_PORT])}"
    chunks = official_stream(facade, COSYVOICE3, official_inputs(TEXT, seed=SEED))  # target_text (and seed) alone
    with sdk.stream(TEXT, voice_id="default", seed=SEED) as native:
        want = [c for c in native if c.size]
    assert_official_stream(chunks, want)


def test_the_facade_answers_the_official_clients_metadata_calls_with_the_family_names(gateway):
    import tritonclient.grpc.aio as aioclient

    async def ask():  # as client_grpc.py asks before and after its requests (statistics, then the model's config)
        client = aioclient.InferenceServerClient(f"127.0.0.1:{gateway.call(lambda app: app[OFFICIAL_TRITON_PORT])}")
        try:
            return (await client.get_inference_statistics(model_name="", as_json=True),
                    await client.get_model_config(COSYVOICE3, as_json=True),
                    await client.get_model_metadata(COSYVOICE3_OFFICIAL, as_json=True),
                    await client.is_model_ready(COSYVOICE3_OFFICIAL_OFFLINE))
        finally:
            await client.close()

    stats, config, metadata, ready = asyncio.run(ask())
    listed = {s["name"] for s in stats["model_stats"]}
    assert set(FAMILY_MODELS["cosyvoice3"]) <= listed and not set(FAMILY_MODELS["cosyvoice2"]) & listed
    assert config["config"]["name"] == COSYVOICE3
    assert config["config"]["parameters"]["family"]["string_value"] == "cosyvoice3"
    assert metadata["name"] == COSYVOICE3_OFFICIAL and ready
    inputs = {i["name"]: i["shape"] for i in metadata["inputs"]}
    assert inputs["reference_wav"] == ["-1", "-1"] and inputs["target_text"] == ["-1", "1"]  # [batch, ...]: official
