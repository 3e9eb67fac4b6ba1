"""The official CosyVoice server APIs on the gateway: the FastAPI routes (/inference_*) driven as the official
runtime/python/fastapi/client.py sends them (a GET with a multipart body, or an urlencoded one), and the gRPC
service cosyvoice.CosyVoice/Inference driven through a stub of our generated modules as
runtime/python/grpc/client.py sends it (prompt_audio raw 16-bit PCM at 16 kHz). With a seed, each answer's
16-bit PCM equals our own /v1/tts's (format pcm, streamed) for the same voice, text, seed and mode; the audio
comes in more than one chunk; unknown voices, missing fields and keys are answered as the docs say; the
proto's field numbers and the generated modules are checked without a server.

One tritonserver (tests/web/stack.py, tiny random model, shared) and two gateways in this process: an open one
and one with an API key, both serving the gRPC API on a free port.
"""
from __future__ import annotations

import argparse
import base64
import importlib.metadata
import io
import logging
import re
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import soundfile as sf

from cosyvoice_triton.gateway import cosyvoice_pb2
from cosyvoice_triton.gateway.access_log import ACCESS_LOGGER
from cosyvoice_triton.gateway.cosyvoice_pb2_grpc import CosyVoiceStub
from cosyvoice_triton.gateway.config import GatewayConfig, Limits, add_gateway_arguments, config_from_args
from cosyvoice_triton.gateway.official_grpc import OFFICIAL_GRPC_PORT
from cosyvoice_triton.gateway.state import DRAIN
from cosyvoice_triton.gateway.testing import GatewayThread
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from triton_harness import metric_value, scrape, wait_for_metric
from web.stack import triton_server, wait_ready

pytestmark = pytest.mark.timeout(300)

REPO_ROOT = Path(__file__).resolve().parents[1]
TEXT = "The official client asks in its own way. A second sentence makes a second chunk."
PROMPT_TEXT = "a short voice prompt"
INSTRUCT = "Speak slowly and warmly."
SEED = 7
KEY = "official-key"
PCM16 = (np.clip(speech_like(3.0, 16000, seed=3, pitch_hz=120.0), -1, 1) * 32767).astype("<i2")  # the prompt
TIMEOUT = 120


def wav_bytes(pcm: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    sf.write(out, pcm, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


PROMPT_WAV = wav_bytes(PCM16)


# ---- the service -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def triton(tmp_path_factory, tiny_model_dir):
    with triton_server(tmp_path_factory.mktemp("official_api"), tiny_model_dir) as served:
        yield served


def serve_gateway(triton, root: Path, **overrides) -> GatewayThread:
    server, model_dir, voice_store = triton
    config = GatewayConfig(triton=(server.target,), voice_store=voice_store, model_dir=model_dir, home=root,
                           shutdown_timeout_s=5.0, official_grpc_port=0, **overrides)
    return GatewayThread(config)


@pytest.fixture(scope="module")
def gateway(triton, tmp_path_factory):
    with serve_gateway(triton, tmp_path_factory.mktemp("official_home")) as thread:
        wait_ready(thread.url)  # voice "default" (with a transcript) registered
        thread.grpc_port = thread.call(lambda app: app[OFFICIAL_GRPC_PORT])
        yield thread


@pytest.fixture(scope="module")
def locked(triton, tmp_path_factory, gateway):
    with serve_gateway(triton, tmp_path_factory.mktemp("official_locked"), api_keys=frozenset({KEY}),
                       default_voice=False) as thread:
        thread.wait_ready()
        thread.grpc_port = thread.call(lambda app: app[OFFICIAL_GRPC_PORT])
        yield thread


@pytest.fixture(scope="module")
def voice_without_transcript(gateway) -> str:
    response = requests.post(gateway.url + "/v1/voices", files={"audio": ("p.wav", PROMPT_WAV, "audio/wav")},
                             timeout=TIMEOUT)
    assert response.status_code in (200, 201), response.text
    assert "zero_shot" not in response.json()["modes"]
    return response.json()["id"]


@pytest.fixture(scope="module")
def ours(gateway):
    """Our /v1/tts's 16-bit PCM (streamed) with TEXT and SEED for a body's voice and mode, each made once."""
    made: dict[str, np.ndarray] = {}

    def pcm(**body) -> np.ndarray:
        key = repr(sorted(body.items()))
        if key not in made:
            response = requests.post(gateway.url + "/v1/tts", timeout=TIMEOUT, json={
                "text": TEXT, "seed": SEED, "format": "pcm", "stream": True, **body})
            assert response.status_code == 200, response.text
            made[key] = np.frombuffer(response.content, "<i2")
            assert made[key].size > 2400
        return made[key]

    return pcm


@pytest.fixture
def access_lines():
    """The access log's lines while the test runs."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(ACCESS_LOGGER).addHandler(handler)
    yield lines
    logging.getLogger(ACCESS_LOGGER).removeHandler(handler)


def recording(**body) -> dict:
    """/v1/tts's fields for the prompt recording the official requests upload."""
    return {"prompt_audio": base64.b64encode(PROMPT_WAV).decode("ascii"), **body}


# ---- the official clients' requests ----------------------------------------------------------------------

def official_http(url: str, mode: str, payload: dict, wav: bytes | None = None,
                  headers: dict | None = None) -> requests.Response:
    """As runtime/python/fastapi/client.py: a GET with the form in its body (multipart with the file)."""
    files = None if wav is None else [("prompt_wav", ("prompt_wav", wav, "application/octet-stream"))]
    return requests.request("GET", f"{url}/inference_{mode}", data=payload, files=files, headers=headers,
                            stream=True, timeout=TIMEOUT)


def http_chunks(response: requests.Response) -> list[bytes]:
    """The body's HTTP chunks, one item each (chunked transfer)."""
    assert response.status_code == 200, response.text
    assert response.headers["Transfer-Encoding"] == "chunked" and response.headers["X-Sample-Rate"] == "24000"
    return [chunk for chunk in response.iter_content(chunk_size=None) if chunk]


def grpc_request(kind: str, **fields) -> cosyvoice_pb2.Request:
    """As runtime/python/grpc/client.py: the payload message filled, then copied into the Request."""
    messages = {"sft_request": cosyvoice_pb2.sftRequest, "zero_shot_request": cosyvoice_pb2.zeroshotRequest,
                "cross_lingual_request": cosyvoice_pb2.crosslingualRequest,
                "instruct_request": cosyvoice_pb2.instructRequest}
    request = cosyvoice_pb2.Request()
    getattr(request, kind).CopyFrom(messages[kind](**fields))
    return request


def official_grpc(port: int, request: cosyvoice_pb2.Request, metadata=(("seed", str(SEED)),)) -> list[bytes]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return [r.tts_audio for r in CosyVoiceStub(channel).Inference(request, metadata=metadata, timeout=TIMEOUT)]


def grpc_error(port: int, request: cosyvoice_pb2.Request, metadata=()) -> tuple[grpc.StatusCode, dict]:
    """(status, trailing metadata) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as failed:
        official_grpc(port, request, metadata)
    return failed.value.code(), dict(failed.value.trailing_metadata() or ())


def same_audio(chunks: list[bytes], want: np.ndarray) -> None:
    """More than one chunk, and the 16-bit samples of `want` (within 1 LSB)."""
    assert len(chunks) > 1, "the audio came in one piece"
    got = np.frombuffer(b"".join(chunks), "<i2")
    assert got.size == want.size
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


# ---- the FastAPI routes ----------------------------------------------------------------------------------

def test_sft_speaks_a_registered_voice_with_its_transcript_as_zero_shot(gateway, ours):
    chunks = http_chunks(official_http(gateway.url, "sft", {"tts_text": TEXT, "spk_id": "default", "seed": SEED}))
    same_audio(chunks, ours(voice_id="default", mode="zero_shot"))


def test_sft_with_a_voice_without_transcript_is_cross_lingual(gateway, ours, voice_without_transcript):
    chunks = http_chunks(official_http(gateway.url, "sft", {"tts_text": TEXT, "spk_id": voice_without_transcript,
                                                            "seed": SEED}))
    same_audio(chunks, ours(voice_id=voice_without_transcript, mode="cross_lingual"))


def test_zero_shot_cross_lingual_and_instruct2_speak_the_uploaded_prompt(gateway, ours):
    cases = [("zero_shot", {"prompt_text": PROMPT_TEXT}, recording(prompt_text=PROMPT_TEXT, mode="zero_shot")),
             ("cross_lingual", {}, recording(mode="cross_lingual")),
             ("instruct2", {"instruct_text": INSTRUCT}, recording(mode="instruct2", instruct=INSTRUCT))]
    for mode, fields, body in cases:
        response = official_http(gateway.url, mode, {"tts_text": TEXT, **fields, "seed": SEED}, PROMPT_WAV)
        assert response.request.method == "GET" and response.request.headers["Content-Type"].startswith(
            "multipart/form-data")
        same_audio(http_chunks(response), ours(**body))


def test_instruct_is_instruct2_in_the_registered_voice_and_post_works_too(gateway, ours):
    payload = {"tts_text": TEXT, "spk_id": "default", "instruct_text": INSTRUCT, "seed": SEED}
    response = official_http(gateway.url, "instruct", payload)
    assert response.request.headers["Content-Type"] == "application/x-www-form-urlencoded"
    want = ours(voice_id="default", mode="instruct2", instruct=INSTRUCT)
    same_audio(http_chunks(response), want)
    posted = requests.post(gateway.url + "/inference_instruct", data=payload, stream=True, timeout=TIMEOUT)
    same_audio(http_chunks(posted), want)


def test_unknown_voice_missing_and_unknown_fields_are_named(gateway):
    def error(response: requests.Response, status: int) -> dict:
        assert response.status_code == status, response.text
        return response.json()["error"]

    assert error(official_http(gateway.url, "sft", {"tts_text": TEXT, "spk_id": "nobody"}), 404)["param"] == "spk_id"
    assert error(official_http(gateway.url, "sft", {"tts_text": TEXT}), 400)["param"] == "spk_id"
    assert error(official_http(gateway.url, "zero_shot", {"tts_text": TEXT}, PROMPT_WAV), 400)["param"] == "prompt_text"
    assert error(official_http(gateway.url, "cross_lingual", {"tts_text": TEXT}), 400)["param"] == "prompt_wav"
    missing = error(requests.get(gateway.url + "/inference_instruct2", timeout=TIMEOUT), 400)
    assert missing["param"] == "tts_text" and "required" in missing["message"]
    unknown = error(official_http(gateway.url, "sft", {"tts_text": TEXT, "spk_id": "default", "speaker": "x"}), 400)
    assert unknown["param"] == "speaker"
    assert error(official_http(gateway.url, "sft", {"tts_text": TEXT, "spk_id": "default", "seed": "x"}),
                 400)["param"] == "seed"


# ---- the gRPC service ------------------------------------------------------------------------------------

def test_grpc_requests_give_our_audio(gateway, ours, access_lines):
    port = gateway.grpc_port
    pcm = PCM16.tobytes()
    cases = [(grpc_request("sft_request", spk_id="default", tts_text=TEXT), dict(voice_id="default", mode="zero_shot")),
             (grpc_request("zero_shot_request", tts_text=TEXT, prompt_text=PROMPT_TEXT, prompt_audio=pcm),
              recording(prompt_text=PROMPT_TEXT, mode="zero_shot")),
             (grpc_request("cross_lingual_request", tts_text=TEXT, prompt_audio=pcm), recording(mode="cross_lingual")),
             (grpc_request("instruct_request", tts_text=TEXT, spk_id="default", instruct_text=INSTRUCT),
              dict(voice_id="default", mode="instruct2", instruct=INSTRUCT))]
    for request, body in cases:
        same_audio(official_grpc(port, request), ours(**body))
    logged = [line for line in access_lines if line.startswith("access GRPC /cosyvoice.CosyVoice/Inference 200 ")]
    assert len(logged) == len(cases)
    for line in logged:  # the random model's audio is audible at once: both figures are there, in order
        fields = dict(part.split("=") for part in line.split()[4:])
        assert float(fields["first_audible_ms"]) >= float(fields["first_chunk_ms"])


def test_grpc_errors_name_the_field_and_are_counted_and_logged(gateway, access_lines):
    port = gateway.grpc_port
    code, trailers = grpc_error(port, grpc_request("instruct_request", tts_text=TEXT, spk_id="nobody",
                                                   instruct_text=INSTRUCT))
    assert code == grpc.StatusCode.NOT_FOUND and trailers["error-param"] == "spk_id"
    assert any(line.startswith("access GRPC /cosyvoice.CosyVoice/Inference 404 ") for line in access_lines)
    code, trailers = grpc_error(port, grpc_request("zero_shot_request", tts_text=TEXT, prompt_text=PROMPT_TEXT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and trailers["error-param"] == "prompt_audio"
    code, trailers = grpc_error(port, grpc_request("cross_lingual_request", tts_text=TEXT,
                                                   prompt_audio=PCM16.tobytes()[:-1]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and trailers["error-param"] == "prompt_audio"
    code, trailers = grpc_error(port, cosyvoice_pb2.Request())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and trailers["error-param"] == "RequestPayload"
    metrics = scrape(gateway.url + "/metrics")  # through the app's middlewares: counted by route and status
    assert metric_value(metrics, "cosyvoice_gateway_requests_total", route="/cosyvoice.CosyVoice/Inference",
                        status="404") >= 1
    assert metric_value(metrics, "cosyvoice_gateway_requests_total", route="/cosyvoice.CosyVoice/Inference",
                        status="400") >= 3


def test_a_grpc_client_that_cancels_cancels_the_synthesis(gateway, triton):
    server = triton[0]
    before = metric_value(scrape(server.metrics_url), "cosyvoice_requests_total", model="cosyvoice2",
                          outcome="cancelled") or 0
    endless = " ".join(["This sentence keeps the stream going on and on."] * 25)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        call = CosyVoiceStub(channel).Inference(grpc_request("sft_request", spk_id="default", tts_text=endless),
                                                timeout=TIMEOUT)
        assert next(call).tts_audio
        call.cancel()
    wait_for_metric(server.metrics_url, "cosyvoice_requests_total", lambda v: (v or 0) >= before + 1,
                    model="cosyvoice2", outcome="cancelled")
    wait_for_metric(gateway.url + "/metrics", "cosyvoice_gateway_requests_total", lambda v: (v or 0) >= 1,
                    route="/cosyvoice.CosyVoice/Inference", status="cancelled")
    wait_for_metric(gateway.url + "/metrics", "cosyvoice_gateway_active_streams", lambda v: v == 0,
                    route="official_grpc")


# ---- keys ------------------------------------------------------------------------------------------------

def test_keys_are_required_on_both_apis_when_configured(locked, ours):
    payload = {"tts_text": TEXT, "spk_id": "default", "seed": SEED}
    assert official_http(locked.url, "sft", payload).status_code == 401
    request = grpc_request("sft_request", spk_id="default", tts_text=TEXT)
    assert grpc_error(locked.grpc_port, request)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_error(locked.grpc_port, request, (("authorization", "Bearer wrong"),))[0] == \
        grpc.StatusCode.UNAUTHENTICATED
    chunks = official_grpc(locked.grpc_port, request, (("authorization", f"Bearer {KEY}"), ("seed", str(SEED))))
    same_audio(chunks, ours(voice_id="default", mode="zero_shot"))


def test_grpc_refusals_carry_a_retry_hint(triton, tmp_path, gateway):  # gateway: voice "default" is there
    """The stream limit (429) and draining (503) as gRPC statuses, with retry-after in the trailing metadata."""
    request = grpc_request("sft_request", spk_id="default", tts_text=TEXT)
    with serve_gateway(triton, tmp_path, default_voice=False, limits=Limits(max_keyless_streams=0)) as thread:
        port = thread.call(lambda app: app[OFFICIAL_GRPC_PORT])
        code, trailers = grpc_error(port, request)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert trailers["error-code"] == "too_many_streams" and trailers["retry-after"] == "1"
        thread.call(lambda app: app[DRAIN].begin("the test drains"))
        code, trailers = grpc_error(port, request)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert trailers["error-code"] == "unavailable" and int(trailers["retry-after"]) >= 1


def test_the_port_flag_of_up_and_the_gateway_cli_fills_the_config():
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)  # `up` and `python -m cosyvoice_triton.gateway` both add these
    assert config_from_args(parser.parse_args([])).official_grpc_port is None  # off by default
    assert config_from_args(parser.parse_args(["--official-grpc-port", "0"])).official_grpc_port == 0
    with pytest.raises(ValueError, match="official-grpc-port"):
        config_from_args(parser.parse_args(["--official-grpc-port", "70000"]))
    up = argparse.ArgumentParser()
    add_gateway_arguments(up, official_ports=True)  # `up`'s: on by default, --no-official-ports closes both
    assert config_from_args(up.parse_args([])).official_grpc_port == 50000
    closed = config_from_args(up.parse_args(["--no-official-ports", "--official-grpc-port", "7"]))
    assert closed.official_grpc_port is None and closed.official_triton_port is None


# ---- the proto and its generated modules (no server) -----------------------------------------------------

def test_the_proto_has_the_official_names_and_field_numbers():
    service = cosyvoice_pb2.DESCRIPTOR.services_by_name["CosyVoice"]
    assert service.full_name == "cosyvoice.CosyVoice"
    method = service.methods_by_name["Inference"]
    assert (method.input_type.full_name, method.output_type.full_name) == ("cosyvoice.Request", "cosyvoice.Response")
    assert method.server_streaming and not method.client_streaming

    def numbers(message: str) -> dict:
        fields = cosyvoice_pb2.DESCRIPTOR.message_types_by_name[message].fields
        return {f.name: (f.number, f.message_type.name if f.message_type else f.type) for f in fields}

    string, raw = 9, 12  # FieldDescriptor.TYPE_STRING, TYPE_BYTES
    assert numbers("Request") == {"sft_request": (1, "sftRequest"), "zero_shot_request": (2, "zeroshotRequest"),
                                  "cross_lingual_request": (3, "crosslingualRequest"),
                                  "instruct_request": (4, "instructRequest")}
    oneof = cosyvoice_pb2.Request.DESCRIPTOR.oneofs_by_name["RequestPayload"]
    assert [f.name for f in oneof.fields] == list(numbers("Request"))
    assert numbers("sftRequest") == {"spk_id": (1, string), "tts_text": (2, string)}
    assert numbers("zeroshotRequest") == {"tts_text": (1, string), "prompt_text": (2, string),
                                          "prompt_audio": (3, raw)}
    assert numbers("crosslingualRequest") == {"tts_text": (1, string), "prompt_audio": (2, raw)}
    assert numbers("instructRequest") == {"tts_text": (1, string), "spk_id": (2, string), "instruct_text": (3, string)}
    assert numbers("Response") == {"tts_audio": (1, raw)}


# The lines that name the generator's version; other grpcio-tools releases write other numbers there.
VERSION_STAMPS = (re.compile(r"Protobuf Python Version: [\w.]+"),
                  re.compile(r"(Domain\.PUBLIC,\s*)\d+,\s*\d+,\s*\d+,"),
                  re.compile(r"GRPC_GENERATED_VERSION = '[^']*'"))


def test_the_checked_in_modules_are_what_the_documented_command_generates(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the modules")
    proto = (REPO_ROOT / "gateway" / "cosyvoice.proto").read_text()
    command = re.search(r"//\s+(mkdir -p build/protos && python -m grpc_tools\.protoc .*)", proto).group(1)
    out = tmp_path / "protos"
    command = command.replace("build/protos", str(out)).replace("python -m", f"{sys.executable} -m")
    command = command.split(" && cp ")[0]  # generate only: compared below
    subprocess.run(command, shell=True, cwd=REPO_ROOT, check=True)
    tools = importlib.metadata.version("grpcio-tools")
    for name in ("cosyvoice_pb2.py", "cosyvoice_pb2_grpc.py"):
        made = (out / "cosyvoice_triton" / "gateway" / name).read_text()
        kept = (REPO_ROOT / "gateway" / name).read_text()
        if f"GRPC_GENERATED_VERSION = '{tools}'" not in (REPO_ROOT / "gateway" / "cosyvoice_pb2_grpc.py").read_text():
            for stamp in VERSION_STAMPS:  # another generator release: all but its version stamps must match
                made, kept = stamp.sub("<version>", made), stamp.sub("<version>", kept)
        assert made == kept, f"gateway/{name} differs from what gateway/cosyvoice.proto's command generates"
