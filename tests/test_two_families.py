"""Both model families behind one gateway: a CosyVoice2 and a CosyVoice3 tritonserver (tiny random folders), one
voice store file they share, and a gateway in this process in front of both (with two API keys).

The router learns each server's family from the server itself and picks by family (unit tests first, no servers).
Then, against the real servers: a request's `model` (on /v1/tts whole and streamed, the WebSocket start message,
the OpenAI route with the official `openai` client) is answered by a server of that family, with the audio that
family's own server gives straight for the same recording; a voice registered once through the gateway is used by
both families (the family it was not registered with makes its features from the recording at first use), and
another key cannot use it; a model no server serves is a 404 naming `model`, also on a gateway in front of the
CosyVoice2 server alone, whose answers are those of a one-family deployment. The servers hold the official
models too: the official Triton clients' requests (gRPC streamed and offline through the facade, KServe JSON) name
`cosyvoice2` or `cosyvoice3` and get that family's own audio, and the facade's metadata calls and listings name
both families' models (a gateway without keys, as the official clients send none).
"""
from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile as sf

from cosyvoice_triton.audio_out import encode
from cosyvoice_triton.client.common import TTSError
from cosyvoice_triton.client.gateway_client import GatewayTTS
from cosyvoice_triton.client.triton_client import TritonTTS
from cosyvoice_triton.errors import NotFound, Unavailable, from_wire
from cosyvoice_triton.gateway.config import GatewayConfig, RoutingConfig
from cosyvoice_triton.gateway.routing import Router
from cosyvoice_triton.gateway.testing import GatewayThread
from cosyvoice_triton.gateway.triton_facade import OFFICIAL_TRITON_PORT
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.server_pool import Server
from cosyvoice_triton.targets import TritonTarget
from cosyvoice_triton.voices.store import owner_tag
from cosyvoice_triton.voices.stores import open_voice_store
from cosyvoice_triton.wire.names import FAMILY_MODELS, WAVEFORM
from test_official_facade import infer as official_infer, kserve_body, stream as official_stream
from test_official_triton import official_inputs
from triton_harness import tritonserver_or_skip

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(420)]

RATIO = 3.0  # max_token_text_ratio: short outputs
RATE = 16000
PROMPT_TEXT = "a short voice prompt"
TEXT = "Hello there, this is a short reply. And a second sentence follows it."
ONE_SENTENCE = "Hello there, this is a short reply."  # one WebSocket segment: one request, the session's seed
SEED = 10
PROMPT = speech_like(2.0, RATE, seed=3, pitch_hz=110.0)
KEY_A, KEY_B = "key-of-tenant-a", "key-of-tenant-b"
VOICE = "mine"  # registered once by KEY_A through the gateway
FAMILIES = ("cosyvoice2", "cosyvoice3")
MAX_S16_DIFF = 8  # 16-bit samples: the float tolerance of the served-equals-in-process tests (2e-4)
ATOL = 2e-4  # that float tolerance (batched flow and vocoder calls may round differently)


# ---- the router without servers -------------------------------------------------------------------------

class ReadyModels:
    """A Triton client stand-in whose server has `models` ready (empty: down)."""

    def __init__(self, *models: str):
        self.models = set(models)

    async def ready(self, model: str, timeout_s: float) -> bool:
        return model in self.models


def family_router(*ready: tuple[str, ...], family: str = "cosyvoice2") -> Router:
    servers = [Server(TritonTarget(f"h{i}:8001", f"http://h{i}:8002/metrics"), ReadyModels(*models))
               for i, models in enumerate(ready)]
    router = Router(servers, RoutingConfig(), family)
    asyncio.run(router.check_all())
    return router


def test_the_router_learns_each_servers_family_and_picks_within_it():
    router = family_router(("cosyvoice2", "llm"), ("cosyvoice3", "cosyvoice3_offline"), ("cosyvoice3",), ())
    cv2, cv3a, cv3b, down = router.servers
    assert [s.family for s in router.servers] == ["cosyvoice2", "cosyvoice3", "cosyvoice3", None]
    assert router.families == ["cosyvoice2", "cosyvoice3"] and not down.healthy
    assert {router.pick(family="cosyvoice3").name for _ in range(4)} == {cv3a.name, cv3b.name}
    assert router.pick(family="cosyvoice2") is cv2
    assert router.pick(exclude=[cv3a], family="cosyvoice3") is cv3b
    with pytest.raises(Unavailable, match="of cosyvoice2"):
        router.pick(exclude=[cv2], family="cosyvoice2")  # never a server of the other family
    # The request's model: a family (any case), one of its Triton models, or none (the configured family here).
    assert [router.family_for(m) for m in ("cosyvoice3", "CosyVoice3", "cosyvoice3_offline", None)] == [
        "cosyvoice3", "cosyvoice3", "cosyvoice3", "cosyvoice2"]
    assert router.family_for("tts-1", any_name=True) == "cosyvoice2"
    with pytest.raises(NotFound) as unknown:
        router.family_for("cosyvoice4")
    assert unknown.value.field == "model" and "cosyvoice2, cosyvoice3" in unknown.value.message
    # A server restarted with the other family's folder is seen as that family at its next check.
    cv2.client.models = {"cosyvoice3"}
    asyncio.run(router.check_all())
    assert cv2.family == "cosyvoice3" and router.families == ["cosyvoice3"]


def test_a_family_no_server_serves_is_not_found_and_one_whose_servers_are_down_is_unavailable():
    router = family_router(("cosyvoice3",), family="cosyvoice2")
    assert router.family_for(None) == "cosyvoice3"  # the servers serve one family: a request naming none gets it
    with pytest.raises(NotFound) as missing:
        router.family_for("cosyvoice2")
    assert missing.value.field == "model" and missing.value.retry_after_s is None
    assert "no cosyvoice2 server" in missing.value.message
    server = router.servers[0]
    server.client.models = set()  # it goes down: still its family's, which is served, but not now
    asyncio.run(router.check_all())
    assert router.family_for("cosyvoice3") == "cosyvoice3" and not server.healthy
    with pytest.raises(Unavailable):
        router.pick(family="cosyvoice3")


def test_the_router_names_the_models_of_every_family_served():
    router = family_router(("cosyvoice2",), ("cosyvoice3",))
    assert router.synthesis_models() == {"cosyvoice2": "cosyvoice2", "cosyvoice2_offline": "cosyvoice2",
                                         "cosyvoice3": "cosyvoice3", "cosyvoice3_offline": "cosyvoice3"}
    assert router.served_family("cosyvoice3_official_offline", "model_name") == "cosyvoice3"
    assert router.served_family("llm") is None and router.served_family("") is None  # any server has it
    one = family_router(("cosyvoice2",))
    assert list(one.synthesis_models()) == ["cosyvoice2", "cosyvoice2_offline"]
    with pytest.raises(NotFound) as missing:
        one.served_family("cosyvoice3_official", "model_name")
    assert missing.value.field == "model_name" and "no cosyvoice3 server" in missing.value.message
    assert list(family_router(()).synthesis_models()) == ["cosyvoice2", "cosyvoice2_offline"]  # none seen: the default


# ---- two real servers, one voice store ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from cosyvoice_triton.random_folder.write import write_random_model

    root = tmp_path_factory.mktemp("two-families")  # seeds of their own: their tokenizers and CAM++ differ too
    return {family: write_random_model(root / family, size="tiny", seed=seed, family=family)
            for seed, family in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared") / "voices.sqlite"


@pytest.fixture(scope="module")
def servers(folders, store_path, tmp_path_factory):
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    binary = tritonserver_or_skip()
    started = {}
    try:
        for family, folder in folders.items():
            run_dir = tmp_path_factory.mktemp(f"{family}-serve")
            options = ServeOptions(model_dir=folder, run_dir=run_dir, address="127.0.0.1", http_port=None,
                                   grpc_port=None, metrics_port=None, voice_store=str(store_path),
                                   max_token_text_ratio=RATIO, torch_threads=1, workers=2, official_models=True)
            started[family] = prepare(options, binary=binary, die_with_parent=True)
            started[family].start()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def straight(servers):
    """Each family's own server, through the Python SDK straight to Triton."""
    clients = {family: TritonTTS(f"127.0.0.1:{server.grpc_port}", model=FAMILY_MODELS[family][0],
                                 offline_model=FAMILY_MODELS[family][1], timeout_s=120)
               for family, server in servers.items()}
    yield clients
    for client in clients.values():
        client.close()


def gateway_config(targets, store_path: Path, home: Path, **extra) -> GatewayConfig:
    return GatewayConfig(triton=tuple(targets), voice_store=str(store_path), home=home,
                         routing=RoutingConfig(health_interval_s=1.0, metrics_interval_s=1.0), **extra)


@pytest.fixture(scope="module")
def gateway(servers, store_path, tmp_path_factory):
    config = gateway_config([servers[f].target for f in FAMILIES], store_path, tmp_path_factory.mktemp("home"),
                            api_keys=frozenset({KEY_A, KEY_B}))
    with GatewayThread(config) as gw:
        gw.wait_ready()
        yield gw


@pytest.fixture(scope="module")
def voice(gateway) -> str:
    """VOICE, registered once by KEY_A through the gateway (whichever server takes the registration)."""
    body = {"audio": base64.b64encode(prompt_file()).decode(), "text": PROMPT_TEXT, "id": VOICE}
    response = requests.post(gateway.url + "/v1/voices", json=body, headers=auth(KEY_A), timeout=120)
    assert response.status_code == 201, response.text
    return VOICE


def prompt_file() -> bytes:
    out = io.BytesIO()
    sf.write(out, PROMPT, RATE, format="WAV", subtype="FLOAT")  # the samples exactly, as the SDK sends them
    return out.getvalue()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def own_server_audio(straight, family: str, text: str = TEXT, stream: bool = True) -> np.ndarray:
    """What `family`'s own server gives for the voice's recording, sent straight to it as a prompt."""
    audio = straight[family].synthesize(text, offline=not stream, seed=SEED, prompt_audio=PROMPT,
                                        prompt_sample_rate=RATE, prompt_text=PROMPT_TEXT)
    assert audio.size > 0
    return audio


def to_s16(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer(encode(samples, "pcm"), "<i2").astype(np.int32)


def assert_same_s16(got: np.ndarray, want: np.ndarray) -> None:
    assert want.size > 0 and got.size == want.size
    assert np.abs(got - want).max() <= MAX_S16_DIFF


def tts_pcm(url: str, key: str | None, **body) -> requests.Response:
    return requests.post(url + "/v1/tts", json={"text": TEXT, "seed": SEED, "format": "pcm", **body},
                         headers=auth(key) if key else {}, timeout=120)


def test_readyz_and_v1_models_name_both_families(gateway):
    status, ready = gateway.get_json("/readyz")
    assert status == 200 and ready["families"] == list(FAMILIES)
    assert ready["family"] == "cosyvoice2"  # several families and no --model-dir: a request naming none
    models = requests.get(gateway.url + "/v1/models", headers=auth(KEY_A), timeout=30).json()
    assert [m["id"] for m in models["data"]] == list(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_v1_tts_speaks_with_the_family_it_names(gateway, straight, voice, family, stream):
    response = tts_pcm(gateway.url, KEY_A, voice_id=voice, model=family, stream=stream)
    assert response.status_code == 200, response.text[:300]
    got = np.frombuffer(response.content, "<i2").astype(np.int32)
    assert_same_s16(got, to_s16(own_server_audio(straight, family, stream=stream)))
    other = next(f for f in FAMILIES if f != family)  # what the other family would have said is not this
    assert not np.array_equal(got, to_s16(own_server_audio(straight, other, stream=stream)))


def test_the_voice_holds_both_familys_features_once_used_by_both(gateway, straight, voice, store_path):
    for family in FAMILIES:  # (each family's first use, if the tests above did not make it)
        assert tts_pcm(gateway.url, KEY_A, voice_id=voice, model=family, stream=True).status_code == 200
    store = open_voice_store(str(store_path))
    try:
        features = {f: store.get(voice, owner_tag(KEY_A), family=f) for f in FAMILIES}  # no encoder: both kept
    finally:
        store.close()
    # Tokenizer v2 and v3, the mels (fmax 8 kHz and 12 kHz) and the folders' CAM++ differ: two sets, one voice.
    for name in ("speech_tokens", "mel", "embedding"):
        assert not np.array_equal(getattr(features["cosyvoice2"], name), getattr(features["cosyvoice3"], name))


def test_a_gateway_keeps_the_recording_of_a_default_voice_stored_without_one(gateway, servers, store_path,
                                                                            tmp_path):
    """The shipped `default` as 0.1.0 stored it (no recording kept): a gateway starting on that store registers
    the shipped recording again, which keeps it on the voice, so every family can make its features from it."""
    import sqlite3

    assert gateway.wait_ready()["default_voice"] == "ready"
    with sqlite3.connect(store_path) as db:
        db.execute("UPDATE voices SET recording = NULL WHERE store_key = 'default'")
    store = open_voice_store(str(store_path))
    try:
        assert not store.info("default").has_recording
        with GatewayThread(gateway_config([servers[f].target for f in FAMILIES], store_path, tmp_path)) as gw:
            assert gw.wait_ready()["default_voice"] == "ready"
        assert open_voice_store(str(store_path)).info("default").has_recording
    finally:
        store.close()


def test_the_websocket_speaks_with_the_family_of_its_start_message(gateway, straight, voice):
    for family in FAMILIES:
        with GatewayTTS(gateway.url, api_key=KEY_A, timeout_s=120) as tts:
            with tts.stream_ws(ONE_SENTENCE, voice_id=voice, seed=SEED, model=family) as chunks:
                got = np.concatenate([c for c in chunks if c.size])
        want = own_server_audio(straight, family, ONE_SENTENCE)
        assert got.size == want.size
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)


def test_the_openai_route_takes_the_model_and_tts_1_is_the_default_family(gateway, straight, voice):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY_A, max_retries=0)
    for model, family in (("cosyvoice3", "cosyvoice3"), ("cosyvoice2", "cosyvoice2"), ("tts-1", "cosyvoice2")):
        pcm = client.audio.speech.create(model=model, voice=voice, input=TEXT, response_format="pcm",
                                         extra_body={"seed": SEED}).content
        assert_same_s16(np.frombuffer(pcm, "<i2").astype(np.int32), to_s16(own_server_audio(straight, family)))


def test_the_web_page_picks_the_model_family(gateway, straight, voice, tmp_path):
    """The page in front of both families shows a model picker (the default family chosen first); its choice
    goes as `model` on the WebSocket (the started answer names it, and the audio is that family's) and on the
    convert tab's form."""
    from test_web_page import page_at, set_file, speak

    from cosyvoice_triton.client import write_wav

    with page_at(gateway.url, tmp_path / "profile") as page:
        page.click("details.settings summary")  # the API key, in the settings
        page.fill("#api-key", KEY_A)
        page.evaluate("document.querySelector('#api-key').blur()")  # its change: the key's voices are listed
        page.wait_for(f"!!document.querySelector('#voice option[value=\"{voice}\"]')", 30)
        assert not page.evaluate("document.querySelector('#model-field').hidden")
        assert page.evaluate("[...document.querySelector('#model').options].map(o => o.value)") == list(FAMILIES)
        assert page.evaluate("document.querySelector('#model').value") == "cosyvoice2"  # /readyz's family
        page.select("#model", "cosyvoice3")
        assert page.text("#family-name") == "CosyVoice3"
        page.select("#voice", voice)
        page.fill("#seed", str(SEED))
        assert speak(page, ONE_SENTENCE) == "done", page.text("#speak-error")
        assert page.text("#used-model") == "cosyvoice3"  # the gateway's started answer: the model it was sent
        played = page.evaluate("state.player.samples")
        set_file(page, "#vc-file", write_wav(tmp_path / "source.wav", PROMPT, RATE))
        assert page.evaluate("conversionForm().then(form => form.get('model'))") == "cosyvoice3"
    assert played == own_server_audio(straight, "cosyvoice3", ONE_SENTENCE).size


def test_another_key_cannot_use_the_voice_with_either_family(gateway, voice):
    for family in FAMILIES:
        response = tts_pcm(gateway.url, KEY_B, voice_id=voice, model=family)
        assert response.status_code == 404 and response.json()["error"]["param"] == "voice_id"


def test_a_model_of_no_family_is_a_404_naming_model(gateway):
    response = tts_pcm(gateway.url, KEY_A, model="cosyvoice9")
    error = response.json()["error"]
    assert response.status_code == 404 and (error["code"], error["param"]) == ("not_found", "model")
    assert "cosyvoice2, cosyvoice3" in error["message"]
    assert tts_pcm(gateway.url, KEY_A, model=7).json()["error"]["param"] == "model"  # 400: not a name


# ---- the official Triton clients in front of both families --------------------------------------------------

@pytest.fixture(scope="module")
def keyless(servers, store_path, tmp_path_factory):
    """A gateway without keys (the official clients send none) with the Triton facade, in front of both servers;
    no page, so / answers its endpoint list."""
    config = gateway_config([servers[f].target for f in FAMILIES], store_path, tmp_path_factory.mktemp("keyless"),
                            official_triton_port=0, default_voice=False, static_dir=tmp_path_factory.mktemp("nopage"))
    with GatewayThread(config) as gw:
        gw.wait_ready()
        yield gw


@pytest.fixture(scope="module")
def own_audio(straight) -> dict[tuple[str, bool], np.ndarray]:
    """Each family's own server's audio for TEXT in the voice of PROMPT: (family, streamed) -> samples."""
    return {(family, stream): own_server_audio(straight, family, stream=stream)
            for family in FAMILIES for stream in (True, False)}


def official_form() -> dict[str, np.ndarray]:
    """The official clients' tensors for PROMPT (zero-padded past reference_wav_len, as they pad), plus our seed."""
    return official_inputs(TEXT, PROMPT, PROMPT_TEXT, padded_to=PROMPT.size + RATE, seed=SEED)


def facade_url(gw) -> str:
    return f"127.0.0.1:{gw.call(lambda app: app[OFFICIAL_TRITON_PORT])}"


async def facade_calls(url: str, *asks) -> list:
    """Each `ask(client)` awaited in turn on one aio Triton client of `url` (as client_grpc.py asks)."""
    import tritonclient.grpc.aio as aioclient

    client = aioclient.InferenceServerClient(url)
    try:
        return [await ask(client) for ask in asks]
    finally:
        await client.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_official_clients_requests_reach_the_family_they_name(keyless, own_audio, family):
    facade = facade_url(keyless)
    streamed = official_stream(facade, family, official_form())  # -> {family}_official on a server of the family
    assert all(chunk.shape[0] == 1 for chunk in streamed)  # [1, n] each, as the official's
    want = own_audio[family, True]
    np.testing.assert_allclose(np.concatenate([c.reshape(-1) for c in streamed]), want, rtol=0, atol=ATOL)
    whole = official_infer(facade, family, official_form())  # -> {family}_official_offline
    assert whole.get_response().model_name == family
    want = own_audio[family, False]
    assert whole.as_numpy(WAVEFORM).shape == (1, want.size)
    np.testing.assert_allclose(whole.as_numpy(WAVEFORM).reshape(-1), want, rtol=0, atol=ATOL)
    answer = requests.post(f"{keyless.url}/v2/models/{family}/infer", json=kserve_body(official_form()),
                           params={"request_id": "0"}, timeout=180)
    assert answer.status_code == 200, answer.text[:300]
    (output,) = answer.json()["outputs"]
    assert answer.json()["model_name"] == family and output["shape"] == [1, want.size]
    np.testing.assert_allclose(np.array(output["data"], np.float32), want, rtol=0, atol=ATOL)


def test_the_facades_metadata_calls_and_listings_name_both_families(keyless):
    stats, index, *per_family = asyncio.run(facade_calls(
        facade_url(keyless), lambda client: client.get_inference_statistics(model_name="", as_json=True),
        lambda client: client.get_model_repository_index(as_json=True),
        *(ask for family in FAMILIES for ask in (
            lambda client, f=family: client.get_model_config(f, as_json=True),
            lambda client, f=family: client.get_model_metadata(f"{f}_official", as_json=True),
            lambda client, f=family: client.is_model_ready(f"{f}_official_offline")))))
    every = {name for family in FAMILIES for name in FAMILY_MODELS[family]}
    for listed in ([s["name"] for s in stats["model_stats"]], [m["name"] for m in index["models"]]):
        assert every <= set(listed) and len(listed) == len(set(listed))  # each model once: llm, token2wav, ...
    for family, (config, metadata, ready) in zip(FAMILIES, zip(*[iter(per_family)] * 3)):
        assert config["config"]["parameters"]["family"]["string_value"] == family  # from a server of the family
        assert metadata["name"] == f"{family}_official" and ready
        assert {i["name"]: i["shape"] for i in metadata["inputs"]}["reference_wav"] == ["-1", "-1"]


def test_kserve_answers_every_familys_models_and_names_model_name_for_others(keyless):
    refused = requests.post(f"{keyless.url}/v2/models/cosyvoice9/infer", json=kserve_body(official_form()), timeout=30)
    assert refused.status_code == 404 and from_wire(refused.json()["error"]).field == "model_name"
    assert "cosyvoice2, cosyvoice2_offline, cosyvoice3, cosyvoice3_offline only" in refused.json()["error"]
    status, listing = keyless.get_json("/")
    assert status == 200 and listing["families"] == list(FAMILIES)
    assert "POST /v2/models/{cosyvoice2,cosyvoice2_offline,cosyvoice3,cosyvoice3_offline}/infer (KServe v2 JSON)" in \
        listing["endpoints"]


def test_a_one_family_gateway_refuses_the_other_family_by_model(servers, store_path, tmp_path):
    """A gateway in front of the CosyVoice2 server alone: what a one-family deployment answers, and the
    family it does not serve named as `model` on every route."""
    config = gateway_config([servers["cosyvoice2"].target], store_path, tmp_path, official_triton_port=0)
    with GatewayThread(config) as gw:
        gw.wait_ready()
        status, ready = gw.get_json("/readyz")
        assert (ready["family"], ready["families"]) == ("cosyvoice2", ["cosyvoice2"])
        assert [m["id"] for m in gw.get_json("/v1/models")[1]["data"]] == ["cosyvoice2"]
        assert tts_pcm(gw.url, None, stream=True).status_code == 200  # no model: the servers' family
        refused = tts_pcm(gw.url, None, model="cosyvoice3")
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
        assert "no cosyvoice3 server" in refused.json()["error"]["message"]
        openai = pytest.importorskip("openai")
        with pytest.raises(openai.NotFoundError) as speech:
            openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0).audio.speech.create(
                model="cosyvoice3", voice="default", input=TEXT)
        assert speech.value.body["param"] == "model"
        with GatewayTTS(gw.url, timeout_s=60) as tts:
            with pytest.raises(TTSError) as ws_refused:
                with tts.stream_ws(ONE_SENTENCE, model="cosyvoice3") as chunks:
                    list(chunks)
        assert (ws_refused.value.status, ws_refused.value.field) == (404, "model")
        kserve = requests.post(f"{gw.url}/v2/models/cosyvoice3/infer", json=kserve_body(official_form()), timeout=30)
        assert kserve.status_code == 404 and from_wire(kserve.json()["error"]).field == "model_name"
        assert "cosyvoice2, cosyvoice2_offline only" in kserve.json()["error"]
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException) as config_refused:
            asyncio.run(facade_calls(facade_url(gw), lambda client: client.get_model_config("cosyvoice3")))
        assert config_refused.value.status() == "StatusCode.NOT_FOUND"
        assert from_wire(config_refused.value.message()).field == "model_name"
        index, ready = asyncio.run(facade_calls(facade_url(gw),
                                                lambda client: client.get_model_repository_index(as_json=True),
                                                lambda client: client.is_model_ready("cosyvoice3")))
        assert not ready  # as Triton answers for a model it does not have
        listed = {m["name"] for m in index["models"]}
        assert set(FAMILY_MODELS["cosyvoice2"]) <= listed and not set(FAMILY_MODELS["cosyvoice3"]) & listed
