"""CosyVoice3 on a real tritonserver: a tiny random CosyVoice3 folder served as `cosyvoice-triton serve` serves it.

One server for the module (on free ports, max_token_text_ratio 3 to keep outputs short) and a gateway in this
process in front of it. The server names its synthesis models for the family (cosyvoice3, cosyvoice3_offline)
and the gateway names the family on /readyz and /v1/models. Every mode streams audio through the Python SDK
equal to the in-process `CosyVoice.from_model_dir` on the same folder with the same seed (streamed and offline,
voice conversion too), and /v1/tts streams the server's own audio for the default voice and an uploaded prompt.
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
