"""Malformed inputs on every gateway endpoint and every Triton model: each gets a 4xx (gateway: a JSON
error naming a field, echoing at most a short piece of the value; Triton: an INVALID_ARG / NOT_FOUND
kind of error, never INTERNAL), nothing dies, and a good request is served afterwards.

The session's shared tritonserver on the tiny random model (tests/web/stack.py) and one keyless gateway of
this module with the rate limits off (the fuzz sends well over a hundred requests in a few seconds). The case
lists are data: each entry is one request.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json

import aiohttp
import numpy as np
import pytest
import requests
import soundfile as sf

from cosyvoice_triton.random_folder.sample_prompt import speech_like

pytestmark = pytest.mark.timeout(600)

RATE = 16000
LONG = "x" * 10_000
MAX_ECHO = 400 + 64  # the gateway's message bound plus a cut field name


def wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


GOOD_WAV = wav(speech_like(2.0, RATE, seed=5))
GARBAGE_WAV = GOOD_WAV[:44] + np.random.default_rng(1).bytes(64_000)  # a WAV header, then noise bytes
SILENT_WAV = wav(np.zeros(RATE * 2, np.float32))
SHORT_WAV = wav(speech_like(0.2, RATE, seed=5))
B64 = {name: base64.b64encode(data).decode() for name, data in
       {"good": GOOD_WAV, "garbage": GARBAGE_WAV, "silent": SILENT_WAV, "short": SHORT_WAV}.items()}
NESTED = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    from cosyvoice_triton.gateway.config import GatewayConfig, Limits, RoutingConfig
    from cosyvoice_triton.gateway.testing import GatewayThread
    from web.stack import triton_server

    with triton_server(tmp_path_factory.mktemp("fuzz"), tiny_model_dir) as (triton, _, store):
        limits = Limits(max_text_chars=300, requests_per_second=0, registrations_per_minute=0)
        config = GatewayConfig(triton=(triton.target,), voice_store=store, model_dir=tiny_model_dir,
                               home=tmp_path_factory.mktemp("home"), limits=limits,
                               routing=RoutingConfig(health_interval_s=1.0, metrics_interval_s=1.0))
        with GatewayThread(config) as gateway:
            gateway.wait_ready()
            yield triton, gateway


def log_size(triton) -> int:
    return triton.log_path.stat().st_size


def log_since(triton, offset: int) -> str:
    """What the server logged after `offset` (the shared server's log holds other modules' requests too)."""
    with open(triton.log_path, "rb") as log:
        log.seek(offset)
        return log.read().decode("utf-8", errors="replace")


# ---- gateway cases: (method, path, kind, payload); kind: json (a value), raw (bytes), form (fields) ------

def tts(**body):
    return ("POST", "/v1/tts", "json", {"text": "Hello.", **body})


def speech(**body):
    return ("POST", "/v1/audio/speech", "json", {"model": "cosyvoice2", "input": "Hello.", "voice": "default",
                                                 "response_format": "wav", **body})


def voice_json(**body):
    return ("POST", "/v1/voices", "json", {"audio": B64["good"], "text": "a prompt", **body})


def voice_form(audio: bytes | str | None = GOOD_WAV, **fields):
    return ("POST", "/v1/voices", "form", {"audio": audio, "text": "a prompt", **fields})


RAW_BODIES = [b"", b"{", b"null", b"[]", b'"text"', b"123", b"\xff\xfe", NESTED.encode(),
              b'{"text": "a\\ud800b."}', b'{"text": "Hi.", "seed": NaN}', b'{"text": "Hi.", "chunk_hop_scale": NaN}',
              b'{"text": "Hi.", "chunk_hop_scale": Infinity}', b'{"text": ' + NESTED.encode() + b"}"]

GATEWAY_CASES = (
    [("POST", "/v1/tts", "raw", body) for body in RAW_BODIES]
    + [("POST", "/v1/audio/speech", "raw", body) for body in RAW_BODIES[:9]]
    + [("POST", "/v1/voices", "raw", body) for body in (b"{", b"[]", b"null", NESTED.encode())]
    + [tts(text=value) for value in (None, 5, [], {}, "", "   ", "x" * 301, "\u001b[31mred", "\x00", "a\x7fb")]
    + [tts(voice_id=value) for value in (5, "", LONG, "bad id!", "../../etc/passwd", "no-such-voice", [1])]
    + [tts(seed=value) for value in (-1, 2**64, "1", 1.5, True, [])]
    + [tts(mode=value) for value in ("nope", 5, "instruct2")]
    + [tts(prompt_audio=value, prompt_text="a prompt") for value in
       ("not base64!!", 5, B64["garbage"], B64["silent"], B64["short"], base64.b64encode(b"RIFF").decode())]
    + [tts(prompt_audio=B64["good"], prompt_text=value) for value in (5, "\u001b[0m", "a\ud800b")]
    + [tts(prompt_audio=B64["good"], voice_id="default", prompt_text="x")]
    + [tts(instruct=value, mode="instruct2") for value in (5, "\x1b")]
    + [tts(chunk_first_hop=v) for v in (-1, "x", 2**40, 0.5)]
    + [tts(chunk_hop_scale=v) for v in ("x", -1, 0, 1e308)]
    + [tts(chunk_max_hop=v) for v in (-5, "big")]
    + [tts(format=v) for v in ("exe", 5, LONG)]
    + [tts(stream=v) for v in ("yes", 1)]
    + [tts(**{LONG: 1}), tts(**{"unknown": 1})]
    + [speech(model=v) for v in (None, 5, "")]
    + [speech(input=v) for v in (None, "", 5, "\u001b[31m", "a\ud800b.", "x" * 301)]
    + [speech(voice=v) for v in (None, 5, "", {"id": 5}, LONG, "bad id!", [])]
    + [speech(response_format=v) for v in ("exe", 5, LONG)]
    + [speech(speed=v) for v in ("fast", 0, 100, [])]  # null is "not given" (1.0), as on /v1/tts
    + [speech(stream_format=v) for v in ("x", 5)]
    + [speech(instructions=v) for v in (5, "\x1b[2J")]
    + [voice_json(audio=v) for v in (None, 5, "not base64!!", B64["garbage"], B64["silent"], B64["short"])]
    + [voice_json(text=v) for v in (5, "\u001b[31m", "a\ud800b", LONG * 2)]
    + [voice_json(id=v) for v in (5, "bad id!", LONG, "v_0123456789abcdef")]
    + [voice_json(name=v) for v in (5, "n" * 1000)]
    + [voice_json(shared=v) for v in ("maybe", 5, True)]
    + [voice_form(audio=None), voice_form(audio="just text"), voice_form(audio=GARBAGE_WAV),
       voice_form(audio=SILENT_WAV), voice_form(id=LONG), voice_form(text="\u001b[31m"),
       voice_form(shared="maybe")]
    + [("POST", "/v1/voices", "raw_text", b"audio=x&text=y")]
    + [(method, f"/v1/voices/{voice}", "none", None) for method in ("GET", "DELETE")
       for voice in ("x" * 2000, "bad%20id", "%00", "..", "no-such-voice")]
    + [("DELETE", "/v1/voices/default", "none", None)]  # keyless: nobody deletes the default voice
    + [("GET", "/v1/tts", "none", None), ("PUT", "/v1/voices", "none", None), ("GET", "/v1/nothing", "none", None)]
)


def send(gateway, case) -> requests.Response:
    method, path, kind, payload = case
    url = gateway.url + path
    if kind == "json":
        return requests.request(method, url, json=payload, timeout=120)
    if kind in ("raw", "raw_text"):
        content_type = "application/json" if kind == "raw" else "text/plain"
        return requests.request(method, url, data=payload, headers={"Content-Type": content_type}, timeout=120)
    if kind == "form":
        fields = dict(payload)
        audio = fields.pop("audio")
        files = {"audio": ("p.wav", audio, "audio/wav")} if isinstance(audio, bytes) else None
        if isinstance(audio, str):
            fields["audio"] = audio
        return requests.request(method, url, data=fields, files=files or {"none": ("x", b"", "text/plain")},
                                timeout=120)
    return requests.request(method, url, timeout=120)


def check_error(case, response: requests.Response) -> None:
    where = f"{case[0]} {case[1]} {str(case[3])[:80]!r}"
    assert 400 <= response.status_code < 500, f"{where}: {response.status_code} {response.text[:300]}"
    error = response.json()["error"]
    assert error["message"] and len(response.text) < MAX_ECHO + 200, f"{where}: {response.text[:300]}"
    assert "0x" not in error["message"] and "object at" not in error["message"], f"{where}: {error}"
    if response.status_code == 400:
        assert error["param"], f"{where}: a 400 must name the field: {error}"


# ---- WebSocket cases: the messages sent after connecting ----------------------------------------------

START = {"type": "start", "voice_id": "default"}
WS_CASES = [
    ["not json"], [b"\x00binary"], [[1, 2]], [NESTED], [{"no": "type"}], [{"type": "text", "text": "early"}],
    [{**START, "unknown": 1}], [{**START, "voice_id": 5}], [{**START, "voice_id": LONG}],
    [{**START, "voice_id": "no-such-voice"}], [{**START, "prompt_audio": B64["garbage"], "voice_id": None}],
    [{**START, "seed": -1}], [{**START, "mode": "nope"}], [{**START, "format": "exe"}],
    [{**START, "text": "\u001b[31m"}], [START, {"type": "text", "text": 5}], [START, {"type": "nope"}],
    [START, {"type": "text", "text": "\x00 zero."}], [START, {"type": "text", "text": "\u001b[31m red. "}],
    [{**START, "chunk_hop_scale": "x"}],
]


async def ws_case(gateway, messages) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(gateway.url + "/v1/tts/ws", max_msg_size=0) as ws:
            for message in messages:
                if isinstance(message, bytes):
                    await ws.send_bytes(message)
                elif isinstance(message, str):
                    await ws.send_str(message)
                else:
                    await ws.send_str(json.dumps(message))
            while True:
                received = await ws.receive(timeout=120)
                if received.type == aiohttp.WSMsgType.TEXT:
                    data = json.loads(received.data)
                    if data["type"] in ("error", "end"):
                        return data
                elif received.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    return {"type": "closed", "code": ws.close_code}


# ---- Triton cases: (model, inputs), called directly ---------------------------------------------------

def s(value: str | bytes) -> np.ndarray:
    return np.array([value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value], dtype=object)


NAN_WAV = np.full(RATE, np.nan, np.float32)
INF_WAV = np.concatenate([speech_like(1.0, RATE, seed=2), [np.inf]]).astype(np.float32)
GOOD_SAMPLES = speech_like(1.0, RATE, seed=2)
RATE_1 = np.array([RATE], np.int32)
MEL = np.zeros((1, 10, 80), np.float32)
EMB = np.zeros((1, 192), np.float32)


def t2w(**values):
    base = {"stream_id": np.array([[b"fuzz"]], dtype=object), "tokens": np.array([[1, 2, 3]], np.int32),
            "prompt_speech_tokens": np.array([[1, 2, 3, 4, 5]], np.int32), "prompt_mel": MEL, "embedding": EMB}
    return ("token2wav", {**base, **values})


UNARY_CASES = [
    ("cosyvoice2_offline", {"target_text": s("\u001b[31mred")}),
    ("cosyvoice2_offline", {"target_text": s("a\ud800b.")}),
    ("cosyvoice2_offline", {"target_text": s(b"\xff\xfe")}),
    ("cosyvoice2_offline", {"target_text": s("")}),
    ("cosyvoice2_offline", {"target_text": s("Hi."), "reference_audio_id": s(LONG)}),
    ("cosyvoice2_offline", {"target_text": s("Hi."), "reference_audio_id": s("no-such-voice")}),
    ("cosyvoice2_offline", {"target_text": s("Hi."), "reference_wav": NAN_WAV, "reference_sample_rate": RATE_1,
                            "reference_text": s("x")}),
    ("cosyvoice2_offline", {"target_text": s("Hi."), "reference_wav": GOOD_SAMPLES,
                            "reference_sample_rate": np.array([0], np.int32), "reference_text": s("x")}),
    ("cosyvoice2_offline", {"target_text": s("Hi."), "reference_audio": s(GARBAGE_WAV), "reference_text": s("x")}),
    ("cosyvoice2_offline", {"target_text": s("Hi."), "mode": s("nope")}),
    ("cosyvoice2_offline", {"target_text": s("Hi."), "chunk_hop_scale": np.array([np.nan], np.float32)}),
    ("cosyvoice2_offline", {"target_text": s("Hi."), "top_p": np.array([np.nan], np.float32)}),
    ("register_voice", {"reference_wav": NAN_WAV, "reference_sample_rate": RATE_1}),
    ("register_voice", {"reference_wav": INF_WAV, "reference_sample_rate": RATE_1}),
    ("register_voice", {"reference_audio": s(GARBAGE_WAV), "reference_text": s("x")}),
    ("register_voice", {"reference_audio": s(b"RIFF")}),
    ("register_voice", {"reference_audio": s(GOOD_WAV), "voice_id": s("bad id!")}),
    ("register_voice", {"reference_audio": s(GOOD_WAV), "owner": s("bad owner!")}),
    ("register_voice", {"reference_audio": s(GOOD_WAV), "reference_text": s("\u001b[31m")}),
    ("register_voice", {"reference_audio": s(GOOD_WAV), "reference_text": s("word " * 4000)}),
    ("register_voice", {"reference_text": s("no audio")}),
    ("speaker_embedding", {"wav16k": NAN_WAV[None]}),
    ("speaker_embedding", {"wav16k": INF_WAV[None]}),
    ("audio_tokenizer", {"wav16k": NAN_WAV[None]}),
    ("audio_tokenizer", {"wav16k": INF_WAV[None]}),
    ("prompt_audio", {"reference_wav": NAN_WAV[None], "reference_sample_rate": RATE_1[None]}),
    ("prompt_encoder", {"reference_wav": INF_WAV[None], "reference_sample_rate": RATE_1[None]}),
    t2w(prompt_mel=np.full((1, 10, 80), np.nan, np.float32)),
    t2w(embedding=np.full((1, 192), np.inf, np.float32)),
    t2w(tokens=np.array([[-5, 10**9]], np.int32)),
    t2w(prompt_mel=np.zeros((1, 7, 80), np.float32)),
    t2w(stream_id=np.array([[b""]], dtype=object)),
]
STREAM_CASES = [
    ("cosyvoice2", {"target_text": s("\u001b[31mred")}),
    ("cosyvoice2", {"target_text": s("Hi."), "reference_audio_id": s(LONG)}),
    ("llm", {"stream_id": s("f1"), "text_tokens": np.array([-1, 10**9], np.int32),
             "seed": np.array([1], np.uint64)}),
    ("llm", {"stream_id": s("f2"), "text_tokens": np.array([], np.int32), "seed": np.array([1], np.uint64)}),
    ("llm", {"stream_id": s("f3"), "text_tokens": np.array([1, 2], np.int32),
             "prompt_speech_tokens": np.array([99999], np.int32), "seed": np.array([1], np.uint64)}),
    ("llm", {"stream_id": s("f4"), "text_tokens": np.array([1, 2], np.int32), "seed": np.array([1], np.uint64),
             "top_p": np.array([np.nan], np.float32)}),
]


def fuzz(triton_grpc_url: str, gateway) -> tuple[int, list[str]]:
    """Send every case; (cases sent, what went wrong)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from triton_harness import GrpcStream, grpc_inputs

    problems, sent = [], 0
    for case in GATEWAY_CASES:
        sent += 1
        try:
            check_error(case, send(gateway, case))
        except AssertionError as exc:
            problems.append(str(exc).splitlines()[0])
    for messages in WS_CASES:
        sent += 1
        answer = asyncio.run(ws_case(gateway, messages))
        if not (answer["type"] == "error" and 400 <= answer["status"] < 500 and len(answer["message"]) <= 410):
            problems.append(f"ws {str(messages)[:80]}: {str(answer)[:300]}")
    client = grpcclient.InferenceServerClient(triton_grpc_url)
    for model, values in UNARY_CASES:
        sent += 1
        try:
            client.infer(model, grpc_inputs(values), client_timeout=120)
            problems.append(f"{model} {list(values)}: accepted")
        except InferenceServerException as exc:
            if exc.status() not in ("StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND"):
                problems.append(f"{model} {list(values)}: {exc.status()} {exc.message()[:200]}")
    with GrpcStream(triton_grpc_url, timeout_s=120) as stream:
        for model, values in STREAM_CASES:
            sent += 1
            errors = [r.error for r in stream.infer(model, values) if r.error]
            if not errors or "internal error" in errors[0]:
                problems.append(f"{model} {list(values)}: {errors}")
    return sent, problems


def test_malformed_inputs_get_4xx_everywhere_and_nothing_dies(stack):
    import tritonclient.grpc as grpcclient

    triton, gateway = stack
    logged_before = log_size(triton)
    sent, problems = fuzz(triton.grpc_url, gateway)
    assert sent >= 100
    assert not problems, "\n".join(problems)

    # nothing died: Triton and the gateway serve a good request on every path
    assert triton.is_running() and grpcclient.InferenceServerClient(triton.grpc_url).is_server_ready()
    good = requests.post(gateway.url + "/v1/tts", json={"text": "Still here.", "seed": 1}, timeout=120)
    assert good.status_code == 200 and sf.read(io.BytesIO(good.content))[0].size > 0
    assert asyncio.run(ws_case(gateway, [{**START, "text": "Still here."}, {"type": "end"}]))["type"] == "end"
    registered = requests.post(gateway.url + "/v1/voices", files={"audio": ("p.wav", GOOD_WAV, "audio/wav")},
                               data={"text": "a prompt"}, timeout=120)
    assert registered.status_code in (200, 201), registered.text
    logged = log_since(triton, logged_before)
    assert "internal error" not in logged, logged[-4000:]


def test_a_transcript_synthesis_could_not_take_is_refused_at_registration(stack):
    triton, gateway = stack
    long_text = " ".join(["a long transcript that never ends"] * 300)  # ~10,000 characters
    refused = requests.post(gateway.url + "/v1/voices", files={"audio": ("p.wav", GOOD_WAV, "audio/wav")},
                            data={"prompt_text": long_text}, timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_text", refused.text
    assert "characters long" in refused.json()["error"]["message"]  # the positions check: test_input_checks
    inline = requests.post(gateway.url + "/v1/tts", json={"text": "Hi.", "prompt_audio": B64["good"],
                                                          "prompt_text": long_text}, timeout=120)
    assert inline.status_code == 400 and inline.json()["error"]["param"] == "prompt_text", inline.text
    fits = requests.post(gateway.url + "/v1/voices", files={"audio": ("p.wav", GOOD_WAV, "audio/wav")},
                         data={"prompt_text": " ".join(["short words"] * 20)}, timeout=120)
    assert fits.status_code in (200, 201), fits.text
    spoken = requests.post(gateway.url + "/v1/tts", json={"text": "Hi there.", "voice_id": fits.json()["id"]},
                           timeout=120)
    assert spoken.status_code == 200, spoken.text


def test_a_websocket_piece_with_a_control_character_is_refused_at_once(stack):
    """Text is checked as it arrives, not when its sentence is complete: a piece without a sentence end is
    refused with a 400 naming `text`, not left in the buffer until the idle timeout (408)."""
    _, gateway = stack
    for messages in ([{**START, "text": "\u001b[31m"}], [START, {"type": "text", "text": "no end \x00 yet"}]):
        answer = asyncio.run(ws_case(gateway, messages))
        assert (answer["type"], answer["status"], answer["param"]) == ("error", 400, "text"), answer
        assert "control character" in answer["message"]
