"""The official CosyVoice Triton clients against the gateway, unchanged: Triton's gRPC protocol on the facade port
(gateway/triton_facade.py) and KServe v2 JSON on the gateway's HTTP port (gateway/routes_kserve.py).

The requests are built as client_grpc.py (streaming: sync `start_stream` + `async_stream_infer(...,
enable_empty_final_response=True)`; offline: the aio client's `infer`) and client_http.py (`POST
/v2/models/cosyvoice2/infer?request_id=0` with nested `data`) send them, naming `cosyvoice2`, in the official form
(tests/test_official_triton.py `official_inputs`), plus our `seed` for equal audio; the audio must equal the same
request sent straight to Triton's cosyvoice2_official / cosyvoice2_official_offline.

One tritonserver (official models on, tiny random model) and one gateway with the facade for the module.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import numpy as np
import pytest
import requests

from cosyvoice_triton.errors import from_wire
from cosyvoice_triton.gateway.config import GatewayConfig, RoutingConfig, config_from_args
from cosyvoice_triton.gateway.testing import GatewayThread
from cosyvoice_triton.gateway.triton_facade import OFFICIAL_TRITON_PORT
from cosyvoice_triton.wire.official import official_model_for
from cosyvoice_triton.client.triton_client import synthesis_request
from test_official_triton import (ATOL, OFFLINE, PROMPT_TEXT, RATE, RATIO, SEED, STREAMING, TEXT, assert_same,
                                  official_inputs, prompt_wav)
from triton_harness import GrpcStream, grpc_inputs, metric_value, scrape, tritonserver_or_skip, wait_for_metric

pytestmark = pytest.mark.timeout(300)

ENDLESS = " ".join(["This sentence keeps the stream going on and on."] * 25)
KEY = "facade-key"


@dataclass
class Stack:
    triton: object  # TritonProcess
    gateway: GatewayThread
    config: GatewayConfig

    @property
    def facade(self) -> str:
        return f"127.0.0.1:{self.gateway.call(lambda app: app[OFFICIAL_TRITON_PORT])}"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    binary = tritonserver_or_skip()
    run_dir = tmp_path_factory.mktemp("facade-triton")
    options = ServeOptions(model_dir=tiny_model_dir, run_dir=run_dir, address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, voice_store=str(run_dir / "voices.sqlite"),
                           max_token_text_ratio=RATIO, torch_threads=1, workers=4, official_models=True)
    triton = prepare(options, binary=binary, die_with_parent=True)
    triton.start()
    config = GatewayConfig(triton=(triton.target,), voice_store=str(run_dir / "voices.sqlite"),
                           model_dir=tiny_model_dir, home=tmp_path_factory.mktemp("home"), default_voice=False,
                           official_triton_port=0,
                           routing=RoutingConfig(health_interval_s=1.0, metrics_interval_s=1.0))
    try:
        with GatewayThread(config) as gateway:
            gateway.wait_ready()
            yield Stack(triton, gateway, config)
    finally:
        triton.stop()


def stream(url: str, model: str, values: dict) -> list[np.ndarray]:
    """client_grpc.py --mode streaming: the chunks; the empty final response must come."""
    import tritonclient.grpc as grpcclient

    with GrpcStream(url, timeout_s=180) as connection:
        responses = connection.infer(model, values, outputs=[grpcclient.InferRequestedOutput("waveform")])
    assert not [r.error for r in responses if r.error]
    assert responses[-1].final and "waveform" not in responses[-1].outputs
    return [r.outputs["waveform"] for r in responses if "waveform" in r.outputs]


def infer(url: str, model: str, values: dict):
    """client_grpc.py --mode offline: the aio client's infer (InferResult)."""
    import tritonclient.grpc.aio as aioclient

    async def call():
        client = aioclient.InferenceServerClient(url)
        try:
            return await client.infer(model, grpc_inputs(values), request_id="100000000",
                                      outputs=[aioclient.InferRequestedOutput("waveform")], client_timeout=180)
        finally:
            await client.close()

    return asyncio.run(call())


def kserve_body(values: dict) -> dict:
    """client_http.py's body: nested data lists, shapes as lists, BYTES as strings."""
    def data(array):
        return [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1)] if array.dtype == object \
            else array.tolist()

    kinds = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.uint64): "UINT64"}
    return {"inputs": [{"name": name, "shape": list(a.shape), "datatype": kinds.get(a.dtype, "BYTES"),
                        "data": data(a)} for name, a in values.items()]}


def post(stack: Stack, model: str, body: dict, headers=None) -> requests.Response:
    return requests.post(f"{stack.gateway.url}/v2/models/{model}/infer", json=body, params={"request_id": "0"},
                         headers=headers, timeout=180)


def official(text: str = TEXT, **kwargs) -> dict:
    wav = prompt_wav()
    return official_inputs(text, wav, PROMPT_TEXT, padded_to=wav.size + 2 * RATE, **kwargs)


# ---- without Triton ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_official_form_requests_for_a_family_go_to_its_official_models(family):
    wav, scalar = [1, 32000], [1, 1]
    official = {"reference_wav": wav, "reference_wav_len": scalar, "reference_text": scalar, "target_text": scalar}
    streaming, offline = f"{family}_official", f"{family}_official_offline"  # cosyvoice2: STREAMING, OFFLINE
    assert official_model_for(family, official, streaming=True) == streaming
    assert official_model_for(family, official, streaming=False) == offline  # ModelInfer, KServe JSON
    assert official_model_for(f"{family}_offline", official, streaming=True) == offline
    assert official_model_for(family, {"target_text": scalar}, streaming=True) == streaming  # spk2info form
    native = {"reference_wav": [32000], "reference_wav_len": [1], "target_text": [1]}  # rank 1: our form
    assert official_model_for(family, native, streaming=False) == family
    assert official_model_for("llm", official, streaming=True) == "llm"
    assert official_model_for(streaming, official, streaming=False) == streaming  # named as it is: kept


def test_the_port_flag_of_up_and_the_gateway_cli_fills_the_config(capsys):
    from cosyvoice_triton.cli import build_parser
    from cosyvoice_triton.gateway.__main__ import build_parser as gateway_parser, main

    parser = build_parser()
    assert config_from_args(parser.parse_args(["up"])).official_triton_port == 8003  # up: on by default
    assert config_from_args(parser.parse_args(["up", "--official-triton-port", "0"])).official_triton_port == 0
    assert config_from_args(parser.parse_args(["up", "--no-official-ports"])).official_triton_port is None
    assert config_from_args(gateway_parser().parse_args([])).official_triton_port is None  # the gateway's: off
    with pytest.raises(SystemExit):
        main(["--official-triton-port", "70000"])  # the gateway's own CLI has it too, checked
    assert "--official-triton-port 70000: expected 0" in capsys.readouterr().err


# ---- against a tritonserver and the gateway ------------------------------------------------------------

def test_streaming_as_client_grpc_equals_triton_and_native_requests_pass_unchanged(stack):
    want = [c.reshape(-1) for c in stream(stack.triton.grpc_url, STREAMING, official())]
    got = stream(stack.facade, "cosyvoice2", official())
    assert len(got) > 1 and all(c.ndim == 2 and c.shape[0] == 1 for c in got)  # [1, n]: cosyvoice2_official's
    assert_same([c.reshape(-1) for c in got], want)
    native = stream(stack.facade, "cosyvoice2", synthesis_request(TEXT, prompt_audio=prompt_wav(), prompt_sample_rate=RATE,
                                                                  prompt_text=PROMPT_TEXT, seed=SEED).tensors())
    assert all(c.ndim == 1 for c in native)  # our cosyvoice2's own answer: the request was passed on as it was
    assert_same(native, want)


def test_offline_as_client_grpc_and_client_http_equal_triton(stack):
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(stack.triton.grpc_url) as client:
        want = client.infer(OFFLINE, grpc_inputs(official()), client_timeout=180).as_numpy("waveform")
    result = infer(stack.facade, "cosyvoice2", official())
    assert result.get_response().model_name == "cosyvoice2"
    np.testing.assert_allclose(result.as_numpy("waveform"), want, rtol=0, atol=ATOL)
    answer = post(stack, "cosyvoice2", kserve_body(official()))
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("waveform", "FP32", list(want.shape))
    np.testing.assert_allclose(np.array(output["data"], np.float32), want.reshape(-1), rtol=0, atol=ATOL)
    gateway_metrics = scrape(stack.gateway.url + "/metrics")  # a whole answer's first chunk and audible audio
    for name in ("cosyvoice_gateway_first_chunk_seconds_count", "cosyvoice_gateway_first_audible_seconds_count"):
        for route in ("kserve", "triton_grpc"):
            assert (metric_value(gateway_metrics, name, route=route) or 0) >= 1, (name, route)


def test_metadata_calls_are_answered_by_a_server(stack):
    import tritonclient.grpc.aio as aioclient

    async def ask():
        client = aioclient.InferenceServerClient(stack.facade)
        try:
            config = await client.get_model_config("cosyvoice2_official", as_json=True)
            stats = await client.get_inference_statistics(model_name="", as_json=True)
            return await client.is_server_live(), await client.is_model_ready("cosyvoice2"), config, stats
        finally:
            await client.close()

    live, ready, config, stats = asyncio.run(ask())
    assert live and ready and config["config"]["max_batch_size"] == 1
    assert {"cosyvoice2", STREAMING, OFFLINE} <= {s["name"] for s in stats["model_stats"]}


def test_bad_inputs_are_named_and_unknown_models_not_found(stack):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    bad = official()
    bad["reference_wav_len"] = np.array([[bad["reference_wav"].shape[1] + 1]], np.int32)  # past the samples
    with grpcclient.InferenceServerClient(stack.facade) as client:
        with pytest.raises(InferenceServerException) as error:
            client.infer("cosyvoice2", grpc_inputs(bad), client_timeout=60)
        assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert from_wire(error.value.message()).field == "reference_wav_len"
        with pytest.raises(InferenceServerException) as unknown:
            client.infer("no_such_model", grpc_inputs(official()), client_timeout=60)
    with grpcclient.InferenceServerClient(stack.triton.grpc_url) as client:
        with pytest.raises(InferenceServerException) as direct:
            client.infer("no_such_model", grpc_inputs(official()), client_timeout=60)
    assert unknown.value.status() == direct.value.status() == "StatusCode.NOT_FOUND"  # as Triton answers it
    assert "no_such_model" in unknown.value.message()
    with GrpcStream(stack.facade, timeout_s=60) as connection:
        (failed,) = [r.error for r in connection.infer("cosyvoice2", bad) if r.error]
    assert from_wire(failed).field == "reference_wav_len"
    answer = post(stack, "cosyvoice2", kserve_body(bad))
    assert answer.status_code == 400 and from_wire(answer.json()["error"]).field == "reference_wav_len"
    short = kserve_body(official())
    short["inputs"][0]["shape"] = [1, 5]  # more data than the shape holds
    answer = post(stack, "cosyvoice2", short)
    assert answer.status_code == 400 and from_wire(answer.json()["error"]).field == "reference_wav"
    assert post(stack, "no_such_model", kserve_body(official())).status_code == 404


def test_a_client_that_leaves_cancels_its_triton_request(stack):
    metrics = stack.triton.metrics_url

    def cancelled():
        return metric_value(scrape(metrics), "cosyvoice_requests_total", model=STREAMING, outcome="cancelled") or 0

    before = cancelled()
    connection = GrpcStream(stack.facade, timeout_s=120)
    request_id = connection.send("cosyvoice2", official(ENDLESS))
    assert "waveform" in connection.next(request_id).outputs
    gateway_metrics = scrape(stack.gateway.url + "/metrics")  # the call counts in the router's bookkeeping
    assert metric_value(gateway_metrics, "cosyvoice_gateway_server_inflight") == 1
    assert metric_value(gateway_metrics, "cosyvoice_gateway_active_streams", route="triton_grpc") == 1
    connection.close(cancel_requests=True)  # most of the audio still to come
    wait_for_metric(metrics, "cosyvoice_requests_total", lambda v: (v or 0) >= before + 1, model=STREAMING,
                    outcome="cancelled")
    wait_for_metric(metrics, "cosyvoice_active_streams", lambda v: v == 0, model=STREAMING)
    wait_for_metric(stack.gateway.url + "/metrics", "cosyvoice_gateway_server_inflight", lambda v: v == 0)


def test_with_api_keys_the_facade_and_the_route_need_one(stack):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with GatewayThread(replace(stack.config, api_keys=frozenset({KEY}))) as locked:
        locked.wait_ready()
        port = locked.call(lambda app: app[OFFICIAL_TRITON_PORT])
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            assert client.is_server_live()  # a probe needs no key
            with pytest.raises(InferenceServerException) as error:
                client.get_model_config("cosyvoice2")
            assert error.value.status() == "StatusCode.UNAUTHENTICATED"
            config = client.get_model_config("cosyvoice2", headers={"authorization": f"Bearer {KEY}"})
            assert config.config.name == "cosyvoice2"
        answer = requests.post(f"{locked.url}/v2/models/cosyvoice2/infer", json={"inputs": []}, timeout=30)
        assert answer.status_code == 401
