"""CosyVoice3 on a real tritonserver: a tiny random CosyVoice3 folder served as `cosyvoice-triton serve` serves it.

One server for the module (on free ports, max_token_text_ratio 3 to keep outputs short) and a gateway in this
process in front of it. The server names its synthesis models for the family (cosyvoice3, cosyvoice3_offline)
and the gateway names the family on /readyz and /v1/models. Every mode streams audio through the Python SDK
equal to the in-process `CosyVoice.from_model_dir` on the same folder with the same seed (streamed and offline,
voice conversion too), and /v1/tts streams the server's own audio for the default voice and an uploaded prompt.
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
import soundfile as sf

from cosyvoice_triton.audio_out import encode
from cosyvoice_triton.client.triton_client import TritonTTS
from cosyvoice_triton.gateway.config import GatewayConfig, RoutingConfig, family_models
from cosyvoice_triton.gateway.testing import GatewayThread
from cosyvoice_triton.messages import ConversionRequest, SynthesisRequest
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.server.templates import model_names
from cosyvoice_triton.wire.names import COSYVOICE2, COSYVOICE2_OFFLINE, COSYVOICE3, COSYVOICE3_OFFLINE, OFFICIAL_MODELS
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
                           synthesis_model=synthesis_model, offline_model=offline_model)
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
        request = SynthesisRequest(text=TEXT, voice=self.voice, mode=mode, instruct_text=instruct, seed=SEED,
                                   sampling=self.tts.llm.config.sampling)
        with self.lock:
            return [chunk for chunk in self.tts.synthesize(request, stream=stream) if chunk.size]

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
    assert {COSYVOICE3, COSYVOICE3_OFFLINE, "llm", "token2wav", "prompt_encoder", "register_voice"} <= set(names)
    # CosyVoice2's names are not there, nor the official tensor form's (CosyVoice2's, asked for here)
    assert not {COSYVOICE2, COSYVOICE2_OFFLINE, *OFFICIAL_MODELS} & set(names)
    for model in (COSYVOICE3, COSYVOICE3_OFFLINE):
        assert get_json(f"http://127.0.0.1:{server.http_port}/v2/models/{model}")["name"] == model
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
