"""CosyVoice2 on a real tritonserver: every model of model_repository/ on a tiny random folder.

One server per session (started like `cosyvoice-triton serve`, on free ports); its audio is compared with
the library's own in-process pipeline (`Orchestrator` over the reference LLM and token2wav) for the same
inputs and seed. The server runs with max_token_text_ratio 3 (the official 20 lets the random LLM speak
~7 times longer than needed here); everything else is as served by default.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.export.sample_prompt import speech_like
from cosyvoice_triton.triton.contracts import synthesis_inputs
from triton_harness import GrpcStream, grpc_inputs, metric_value, scrape, tritonserver_or_skip, wait_for_metric

REPO_ROOT = Path(__file__).resolve().parents[1]
RATIO = 3.0
RATE = 16000
PROMPT_TEXT = "a short voice prompt"
LONG_TEXT = ("The first sentence of this request is long enough to be split from the next one, so that the server "
             "has to stream several sentences in order, one after the other, without waiting. Then a second "
             "sentence follows with a few more words in it, to give the speech model some text to read aloud.")
# Equal audio up to float rounding: batched flow and vocoder calls add rows of other streams (padded).
ATOL = 2e-4


# ---- fixtures --------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from cosyvoice_triton.export.random_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", seed=0)


@pytest.fixture(scope="session")
def cv_server(tiny_model, tmp_path_factory):
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    binary = tritonserver_or_skip()
    run_dir = tmp_path_factory.mktemp("serve")
    options = ServeOptions(model_dir=tiny_model, run_dir=run_dir, address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, voice_store=str(run_dir / "voices.sqlite"),
                           max_token_text_ratio=RATIO, torch_threads=1, workers=12)
    server = prepare(options, binary=binary, die_with_parent=True)
    server.start()
    with GrpcStream(server.grpc_url, timeout_s=120) as stream:  # warm-up: first calls are slow (lazy init)
        waveforms(stream.infer("cosyvoice2", synthesis_inputs("Warm up.", samples=prompt_wav(9), sample_rate=RATE,
                                                              reference_text=PROMPT_TEXT, seed=0)))
    yield server
    server.stop()


class Reference:
    """The library's in-process pipeline on the same folder."""

    def __init__(self, model_dir: Path):
        import torch

        from cosyvoice_triton.runtime.orchestrator import Orchestrator, ReferenceLLM, ReferenceToken2Wav
        from cosyvoice_triton.runtime.synthesizer import CosyVoice2

        torch.set_num_threads(1)
        self.tts = CosyVoice2.from_model_dir(model_dir)
        self.tts.llm.config.max_token_text_ratio = RATIO
        self.orchestrator = Orchestrator(self.tts.frontend, ReferenceLLM(self.tts.llm),
                                         ReferenceToken2Wav(self.tts.token2wav))
        self.lock = threading.Lock()

    def voice(self, wav: np.ndarray, text: str = PROMPT_TEXT):
        return self.tts.encode_voice(wav, RATE, text)

    def chunks(self, text: str, voice, seed: int, stream: bool = True, mode: str = "zero_shot",
               limit: int | None = None, **policy) -> list[np.ndarray]:
        """The request's chunks (the first `limit` only, when given: the rest is not computed)."""
        from cosyvoice_triton.runtime.chunk_policy import ChunkPolicy
        from cosyvoice_triton.runtime.request import SynthesisRequest

        request = SynthesisRequest(text=text, voice=voice, mode=mode, seed=seed,
                                   sampling=self.tts.llm.config.sampling,
                                   chunk_policy=ChunkPolicy().with_overrides(**policy))
        out = []
        with self.lock:
            run = self.orchestrator.run(request, stream=stream)
            for chunk in run:
                if chunk.size:
                    out.append(chunk)
                if limit is not None and len(out) == limit:
                    run.close()
                    break
        return out


@pytest.fixture(scope="session")
def reference(tiny_model) -> Reference:
    return Reference(tiny_model)


def prompt_wav(index: int) -> np.ndarray:
    return speech_like(1.5 + 0.25 * (index % 4), RATE, seed=index, pitch_hz=95.0 + 12 * index)


def assert_same_audio(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert [c.size for c in got] == [c.size for c in want]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), rtol=0, atol=ATOL)


def waveforms(responses) -> list[np.ndarray]:
    errors = [r.error for r in responses if r.error]
    assert not errors, errors
    return [r.outputs["waveform"] for r in responses if "waveform" in r.outputs]


def metric(server, name: str, **labels) -> float:
    return metric_value(scrape(server.metrics_url), name, **labels) or 0.0


# ---- streaming --------------------------------------------------------------------------------------

def test_streams_a_long_text_in_chunks_equal_to_the_library(cv_server, reference):
    wav = prompt_wav(0)
    values = synthesis_inputs(LONG_TEXT, samples=wav, sample_rate=RATE, reference_text=PROMPT_TEXT, seed=11)
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        request_id = stream.send("cosyvoice2", values)
        first = stream.next(request_id)
        assert first.error is None and first.outputs["waveform"].size > 0
        # The first chunk has left while the request is still being synthesized.
        assert metric(cv_server, "cosyvoice_active_streams", model="cosyvoice2") >= 1
        responses = [first] + stream.collect(request_id)
    assert responses[-1].final and not responses[-1].outputs  # enable_empty_final_response
    got = waveforms(responses)
    assert len(reference.tts.frontend.split(LONG_TEXT)) >= 2
    assert len(got) >= 4
    assert_same_audio(got, reference.chunks(LONG_TEXT, reference.voice(wav), seed=11))


def _run_stream(url: str, values: dict, cancel_after: int | None, out: dict, key: int) -> None:
    stream = GrpcStream(url, timeout_s=180)
    try:
        request_id = stream.send("cosyvoice2", values)
        chunks = []
        while True:
            response = stream.next(request_id)
            if response.error:
                out[key] = RuntimeError(response.error)
                return
            if "waveform" in response.outputs:
                chunks.append(response.outputs["waveform"])
            if cancel_after is not None and len(chunks) >= cancel_after:
                stream.close(cancel_requests=True)
                out[key] = chunks
                return
            if response.final:
                out[key] = chunks
                return
    except Exception as exc:  # noqa: BLE001 - reported by the test
        out[key] = exc
    finally:
        if cancel_after is None:
            stream.close()


# One sentence of ~550 text tokens: its LLM stream (up to 3 x 550 speech tokens) is still running when
# the client cancels after the first chunk, which comes early (small first hop).
ENDLESS = ", ".join(["this clause keeps the one sentence going on and on"] * 25) + "."
CONCURRENT_TEXTS = [
    "Hello world, this is stream number one.",
    "A second voice reads a different line of text.",
    "Number three speaks about the weather today.",
    "The fourth stream is here to keep the others company.",
    ENDLESS,  # cancelled
    "Five is a good number for a test of batching.",
    ENDLESS.replace("keeps", "makes"),  # cancelled
    "The last stream says goodbye to everyone.",
]
CANCELLED = (4, 6)
FIRST_HOP = 4
# The random LLM may draw a stop token early; with these seeds its streams of ENDLESS run to ~max length.
SEEDS = [100, 101, 102, 103, 404, 105, 406, 107]


def test_concurrent_streams_equal_their_solo_runs_and_cancelled_ones_free_their_state(cv_server, reference):
    counters = (("cosyvoice_llm_streams_total", "llm", "cancelled"),
                ("cosyvoice_token2wav_streams_freed_total", "token2wav", "cancel"))
    before = {key: metric(cv_server, key[0], model=key[1], reason=key[2]) for key in counters}
    wavs = [prompt_wav(i) for i in range(len(CONCURRENT_TEXTS))]
    requests = [synthesis_inputs(text, samples=wavs[i], sample_rate=RATE, reference_text=PROMPT_TEXT, seed=SEEDS[i])
                for i, text in enumerate(CONCURRENT_TEXTS)]
    for i in CANCELLED:
        requests[i]["chunk_first_hop"] = np.array([FIRST_HOP], np.int32)
    results: dict[int, object] = {}
    threads = [threading.Thread(target=_run_stream, args=(cv_server.grpc_url, values,
                                                           1 if i in CANCELLED else None, results, i))
               for i, values in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    failures = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert not failures and len(results) == len(requests), failures

    # The cancelled streams gave up their LLM slot and token2wav state; nothing is left behind.
    for (name, model, reason), value in before.items():
        wait_for_metric(cv_server.metrics_url, name, lambda v, value=value: v is not None and v >= value + len(CANCELLED),
                        model=model, reason=reason)
    for name, model in (("cosyvoice_llm_active_streams", "llm"), ("cosyvoice_token2wav_active_streams", "token2wav"),
                        ("cosyvoice_active_streams", "cosyvoice2")):
        wait_for_metric(cv_server.metrics_url, name, lambda v: v == 0, model=model)
    assert metric(cv_server, "cosyvoice_llm_free_slots", model="llm") == 8
    for (name, model, reason), value in before.items():
        assert metric(cv_server, name, model=model, reason=reason) == value + len(CANCELLED), name

    # Every other stream is its solo run: nothing was mixed between streams.
    for i, text in enumerate(CONCURRENT_TEXTS):
        if i in CANCELLED:
            want = reference.chunks(text, reference.voice(wavs[i]), seed=SEEDS[i], limit=1, first_hop=FIRST_HOP)
            assert_same_audio(results[i], want)
        else:
            want = reference.chunks(text, reference.voice(wavs[i]), seed=SEEDS[i])
            assert_same_audio(results[i], want)
    batched = scrape(cv_server.metrics_url)
    assert (metric_value(batched, "cosyvoice_token2wav_batch_size_sum", model="token2wav")
            > metric_value(batched, "cosyvoice_token2wav_batch_size_count", model="token2wav"))  # some batch > 1


# ---- voices, HTTP, errors ---------------------------------------------------------------------------

def register(server, wav: np.ndarray, text: str, **extra) -> str:
    import tritonclient.grpc as grpcclient

    values = {"reference_wav": wav.astype(np.float32), "reference_sample_rate": np.array([RATE], np.int32),
              "reference_text": np.array([text.encode()], dtype=object), **extra}
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer("register_voice", grpc_inputs(values))
    return result.as_numpy("voice_id")[0].decode()


def http_infer(server, model: str, values: dict) -> dict:
    """Plain JSON over HTTP: POST /v2/models/<model>/infer."""
    inputs = []
    for name, value in values.items():
        array = np.asarray(value)
        if array.dtype == object:
            datatype, data = "BYTES", [v.decode() for v in array.reshape(-1)]
        else:
            datatype = {"float32": "FP32", "int32": "INT32", "uint64": "UINT64"}[array.dtype.name]
            data = array.reshape(-1).tolist()
        inputs.append({"name": name, "shape": list(array.shape), "datatype": datatype, "data": data})
    body = json.dumps({"inputs": inputs}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/infer", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_http_infer_on_the_twin_returns_the_whole_waveform(cv_server, reference):
    wav = prompt_wav(3)
    voice_id = register(cv_server, wav, PROMPT_TEXT)
    text = "Offline synthesis returns everything at once. It has two sentences in it."
    answer = http_infer(cv_server, "cosyvoice2_offline", synthesis_inputs(text, voice_id=voice_id, seed=5))
    (output,) = answer["outputs"]
    assert output["name"] == "waveform" and output["datatype"] == "FP32"
    waveform = np.asarray(output["data"], dtype=np.float32)
    want = np.concatenate(reference.chunks(text, reference.voice(wav), seed=5, stream=False))
    assert output["shape"] == [want.size]
    np.testing.assert_allclose(waveform, want, rtol=0, atol=ATOL)


def test_register_voice_is_idempotent_and_serves_by_id(cv_server, reference):
    wav = prompt_wav(5)
    voice_id = register(cv_server, wav, PROMPT_TEXT)
    assert register(cv_server, wav, PROMPT_TEXT) == voice_id
    assert register(cv_server, wav, "another transcript") != voice_id
    hits = metric(cv_server, "cosyvoice_voice_store_hits_total", model="cosyvoice2") + \
        metric(cv_server, "cosyvoice_voice_store_loads_total", model="cosyvoice2")
    text = "Synthesis by a registered voice id."
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        by_id = waveforms(stream.infer("cosyvoice2", synthesis_inputs(text, voice_id=voice_id, seed=3)))
        by_wav = waveforms(stream.infer("cosyvoice2", synthesis_inputs(text, samples=wav, sample_rate=RATE,
                                                                       reference_text=PROMPT_TEXT, seed=3)))
    assert_same_audio(by_id, by_wav)
    assert_same_audio(by_id, reference.chunks(text, reference.voice(wav), seed=3))
    assert metric(cv_server, "cosyvoice_voice_store_hits_total", model="cosyvoice2") + \
        metric(cv_server, "cosyvoice_voice_store_loads_total", model="cosyvoice2") == hits + 1


def _error_of(server, values: dict, model: str = "cosyvoice2") -> str:
    with GrpcStream(server.grpc_url, timeout_s=60) as stream:
        responses = stream.infer(model, values)
    errors = [r.error for r in responses if r.error]
    assert errors, f"no error for {sorted(values)}"
    return errors[0]


def _good(index: int = 0, **override) -> dict:
    values = synthesis_inputs("Good input.", samples=prompt_wav(index), sample_rate=RATE,
                              reference_text=PROMPT_TEXT, seed=1)
    values.update(override)
    return values


@pytest.mark.parametrize("case, values, field", [
    ("empty text", lambda: _good(target_text=np.array([b"  "], dtype=object)), "target_text"),
    ("unknown voice", lambda: synthesis_inputs("Hi.", voice_id="no-such-voice"), "reference_audio_id"),
    ("corrupt audio file", lambda: synthesis_inputs("Hi.", reference_text=PROMPT_TEXT,
                                                   reference_audio=np.array([b"RIFF not audio"], dtype=object)),
     "reference_audio"),
    ("corrupt samples", lambda: _good(reference_wav=np.full(RATE, np.nan, np.float32)), "reference_wav"),
    ("too long audio", lambda: _good(reference_wav=speech_like(31.0, 8000), reference_sample_rate=np.array(
        [8000], np.int32)), "reference_wav"),
    ("wrong dtype", lambda: _good(reference_wav=prompt_wav(0).astype(np.float64)), "reference_wav"),
    ("wrong shape", lambda: _good(target_text=np.array([b"a", b"b"], dtype=object)), "target_text"),
    ("no rate", lambda: {k: v for k, v in _good().items() if k != "reference_sample_rate"}, "reference_sample_rate"),
    ("bad mode", lambda: _good(mode=np.array([b"sing"], dtype=object)), "mode"),
    ("zero-shot without transcript", lambda: {k: v for k, v in _good().items() if k != "reference_text"},
     "reference_text"),
    ("bad chunk policy", lambda: _good(chunk_first_hop=np.array([1], np.int32)), "chunk_first_hop"),
])
def test_bad_inputs_name_the_field_and_the_server_carries_on(cv_server, case, values, field):
    message = _error_of(cv_server, values())
    assert field in message, f"{case}: {message}"


def test_register_voice_rejects_bad_audio(cv_server):
    message = _error_of(cv_server, {"reference_wav": np.zeros(RATE, np.float32),
                                    "reference_sample_rate": np.array([RATE], np.int32)}, model="register_voice")
    assert "reference_wav" in message and "silent" in message


def test_a_good_request_after_the_bad_ones(cv_server, reference):
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        got = waveforms(stream.infer("cosyvoice2", _good(2)))
    assert_same_audio(got, reference.chunks("Good input.", reference.voice(prompt_wav(2)), seed=1))


# ---- perf_analyzer ---------------------------------------------------------------------------------

def test_perf_analyzer_streams_from_cosyvoice2(cv_server, tmp_path):
    path = Path(os.environ.get("PERF_ANALYZER", REPO_ROOT / "build" / "perf_analyzer" / "bin" / "perf_analyzer"))
    if not os.access(path, os.X_OK):
        pytest.skip(f"perf_analyzer not installed at {path}: run perf/install_perf_analyzer.sh")
    data = REPO_ROOT / "perf" / "inputs" / "cosyvoice2_zero_shot.json"
    cmd = [str(path), "-m", "cosyvoice2", "-i", "grpc", "--streaming", "-u", cv_server.grpc_url,
           "--input-data", str(data), "--concurrency-range", "2", "--measurement-mode", "count_windows",
           "--measurement-request-count", "4", "--stability-percentage", "999", "-f", str(tmp_path / "pa.csv")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Detected decoupled model" in out.stdout
    assert (tmp_path / "pa.csv").read_text().startswith("Concurrency,")


# ---- restart: last, it restarts the session's server ---------------------------------------------------

def test_a_registered_voice_survives_a_restart(cv_server):
    wav = prompt_wav(6)
    voice_id = register(cv_server, wav, PROMPT_TEXT)
    values = synthesis_inputs("Still the same voice after a restart.", voice_id=voice_id, seed=9)
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        before = waveforms(stream.infer("cosyvoice2", values))
    assert cv_server.stop() == 0
    cv_server.start()
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        after = waveforms(stream.infer("cosyvoice2", values))
    assert_same_audio(after, before)
    assert metric(cv_server, "cosyvoice_voice_store_loads_total", model="cosyvoice2") == 1  # read from the file
