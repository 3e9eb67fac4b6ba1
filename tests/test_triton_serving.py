"""CosyVoice2 on a real tritonserver: every model of model_repository/ on a tiny random folder.

One server per session (started like `cosyvoice-triton serve`, on free ports); its audio is compared with
the library's own in-process pipeline (`Pipeline` over the reference LLM and token2wav) for the same
inputs and seed. The server runs with max_token_text_ratio 3 (the official 20 lets the random LLM speak
~7 times longer than needed here); everything else is as served by default. No test depends on another
having run: the restart test restarts the session's server and leaves it warm, and the idle-timeout
test starts a token2wav-only server of its own.
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

from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.client.triton_client import synthesis_request
from triton_harness import (GrpcStream, grpc_inputs, metric_samples, metric_value, scrape, tritonserver_or_skip,
                            wait_for_metric)

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
    from cosyvoice_triton.random_folder.write import write_random_model

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
    warm_up(server)
    yield server
    server.stop()


def warm_up(server) -> None:
    """One synthesis by recording (the voice store is not read): the first calls are slow (lazy init)."""
    with GrpcStream(server.grpc_url, timeout_s=120) as stream:
        waveforms(stream.infer("cosyvoice2", synthesis_request("Warm up.", prompt_audio=prompt_wav(9), prompt_sample_rate=RATE,
                                                              prompt_text=PROMPT_TEXT, seed=0).tensors()))


class Reference:
    """The library's in-process pipeline on the same folder."""

    def __init__(self, model_dir: Path):
        import torch

        from cosyvoice_triton.pipeline.local_stages import ReferenceLLM, ReferenceToken2Wav
        from cosyvoice_triton.pipeline.pipeline import Pipeline
        from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2

        torch.set_num_threads(1)
        self.tts = CosyVoice2.from_model_dir(model_dir)
        self.tts.llm.config.max_token_text_ratio = RATIO
        self.pipeline = Pipeline(self.tts.preprocessor, ReferenceLLM(self.tts.llm),
                                 ReferenceToken2Wav(self.tts.token2wav))
        self.lock = threading.Lock()

    def voice(self, wav: np.ndarray, text: str = PROMPT_TEXT):
        return self.tts.encode_voice(wav, RATE, text)

    def chunks(self, text: str, voice, seed: int, stream: bool = True, mode: str = "zero_shot",
               limit: int | None = None, instruct_text: str = "", **policy) -> list[np.ndarray]:
        """The request's chunks (the first `limit` only, when given: the rest is not computed)."""
        from cosyvoice_triton.messages import ChunkPolicy
        from cosyvoice_triton.messages import SynthesisRequest

        request = SynthesisRequest(text=text, voice=voice, mode=mode, instruct_text=instruct_text, seed=seed,
                                   sampling=self.tts.llm.config.sampling,
                                   chunk_policy=ChunkPolicy().with_overrides(**policy))
        out = []
        with self.lock:
            run = self.pipeline.run(request, stream=stream)
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


def value(text: str, name: str, **labels) -> float:
    """`name` summed over its samples with `labels` in scraped `text`; 0 when there is none."""
    return metric_value(text, name, **labels) or 0.0


# ---- streaming --------------------------------------------------------------------------------------

# Work counters of the server: chunk requests that token2wav took in, and LLM streams (one per sentence) that ended.
T2W_CHUNKS = ("cosyvoice_token2wav_batch_size_sum", {"model": "token2wav"})
LLM_ENDED = ("cosyvoice_llm_streams_total", {"model": "llm"})


def work_done(text: str) -> tuple[float, float]:
    return value(text, T2W_CHUNKS[0], **T2W_CHUNKS[1]), value(text, LLM_ENDED[0], **LLM_ENDED[1])


def test_streams_a_long_text_in_chunks_equal_to_the_library(cv_server, reference):
    wav = prompt_wav(0)
    values = synthesis_request(LONG_TEXT, prompt_audio=wav, prompt_sample_rate=RATE, prompt_text=PROMPT_TEXT, seed=11).tensors()
    sentences = len(reference.tts.preprocessor.split(LONG_TEXT))
    assert sentences >= 2
    chunks0, ended0 = work_done(scrape(cv_server.metrics_url))
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        request_id = stream.send("cosyvoice2", values)
        first = stream.next(request_id)
        assert first.error is None and first.outputs["waveform"].size > 0
        at_first = work_done(scrape(cv_server.metrics_url))  # what the server had made when the first chunk came
        responses = [first] + stream.collect(request_id)
    assert responses[-1].final and not responses[-1].outputs  # enable_empty_final_response
    got = waveforms(responses)
    assert len(got) >= 4
    assert_same_audio(got, reference.chunks(LONG_TEXT, reference.voice(wav), seed=11))

    # The first chunk left before the rest was made: when it arrived, token2wav had taken in fewer chunk
    # requests than the stream needed in all, and the LLM had not finished every sentence.
    ended_all = wait_for_metric(cv_server.metrics_url, LLM_ENDED[0], lambda v: v is not None and v >= ended0 + sentences,
                                **LLM_ENDED[1])
    chunks_all = value(scrape(cv_server.metrics_url), T2W_CHUNKS[0], **T2W_CHUNKS[1])
    assert chunks_all - chunks0 >= len(got) and ended_all == ended0 + sentences
    assert 1 <= at_first[0] - chunks0 < chunks_all - chunks0, (chunks0, at_first, chunks_all)
    assert at_first[1] - ended0 < sentences, (ended0, at_first, ended_all)


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
    requests = [synthesis_request(text, prompt_audio=wavs[i], prompt_sample_rate=RATE, prompt_text=PROMPT_TEXT, seed=SEEDS[i]).tensors()
                for i, text in enumerate(CONCURRENT_TEXTS)]
    for i in CANCELLED:
        requests[i]["chunk_first_hop"] = np.array([FIRST_HOP], np.int32)
    results: dict[int, object] = {}
    threads = [threading.Thread(target=_run_stream, args=(cv_server.grpc_url, values,
                                                           1 if i in CANCELLED else None, results, i))
               for i, values in enumerate(requests)]
    # The cancelled streams start first: their first chunk (a small first hop) then comes before token2wav is
    # busy with the others' chunks, well before their long LLM stream ends, also on a loaded machine.
    for i in (*CANCELLED, *(i for i in range(len(threads)) if i not in CANCELLED)):
        threads[i].start()
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


# ---- custom metrics ---------------------------------------------------------------------------------

def test_custom_metrics_move_with_requests(cv_server):
    """Every custom metric the models export, on the metrics port: a voice registered, two syntheses by its
    id (the first loads it from the store, the second is an LRU hit) and one by an unknown id (a miss)."""
    voice_id = register(cv_server, prompt_wav(7), PROMPT_TEXT)  # a voice no test has synthesized with
    labels = {"model": "cosyvoice2"}
    before = scrape(cv_server.metrics_url)
    text = "Two syntheses by one voice id, and then one by an id that nobody registered."
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        chunks = [waveforms(stream.infer("cosyvoice2", synthesis_request(text, voice_id=voice_id, seed=s).tensors()))
                  for s in (31, 32)]
    assert all(chunks)
    assert "reference_audio_id" in _error_of(cv_server, synthesis_request("Hi.", voice_id="nobody-has-this-id").tensors())

    # Counted as each request ends (just after its final response): one load, one hit, one miss; 2 ok, 1 error.
    counters = [("cosyvoice_voice_store_loads_total", {}, 1), ("cosyvoice_voice_store_hits_total", {}, 1),
                ("cosyvoice_voice_store_misses_total", {}, 1), ("cosyvoice_requests_total", {"outcome": "ok"}, 2),
                ("cosyvoice_requests_total", {"outcome": "error"}, 1)]
    for name, extra, delta in counters:
        want = value(before, name, **extra, **labels) + delta
        wait_for_metric(cv_server.metrics_url, name, lambda v, want=want: v is not None and v >= want,
                        **extra, **labels)
    after = scrape(cv_server.metrics_url)
    for name, extra, delta in counters:
        assert value(after, name, **extra, **labels) == value(before, name, **extra, **labels) + delta, (name, extra)

    # First-chunk latency: one observation per stream that sent audio (not the failed one).
    first = "cosyvoice_first_chunk_latency_seconds"
    assert value(after, first + "_count", **labels) == value(before, first + "_count", **labels) + 2
    assert value(after, first + "_sum", **labels) > value(before, first + "_sum", **labels)
    inf_bucket = value(after, first + "_bucket", le="+Inf", **labels)
    assert inf_bucket == value(after, first + "_count", **labels)

    # LLM: the latest decode step had rows, and tokens were sent in the last seconds.
    assert value(after, "cosyvoice_llm_batch_size", model="llm") >= 1
    assert value(after, "cosyvoice_llm_tokens_per_second", model="llm") > 0
    assert value(after, "cosyvoice_llm_active_streams", model="llm") == 0

    # token2wav: batches observed, at least one chunk request per audio chunk; nothing queued or held.
    batch = "cosyvoice_token2wav_batch_size"
    assert value(after, batch + "_count", model="token2wav") > value(before, batch + "_count", model="token2wav")
    assert value(after, batch + "_sum", model="token2wav") - value(before, batch + "_sum", model="token2wav") >= \
        sum(len(c) for c in chunks)
    assert value(after, "cosyvoice_token2wav_flow_batch", model="token2wav") >= 1
    assert value(after, "cosyvoice_token2wav_active_streams", model="token2wav") == 0
    # token2wav's queue is Triton's own pending count (see cosyvoice_triton/triton/metrics.py).
    pending = metric_samples(after, "nv_inference_pending_request_count")
    assert [v for lab, v in pending if lab.get("model") == "token2wav"] == [0.0], pending


# ---- modes other than zero_shot ---------------------------------------------------------------------

@pytest.mark.parametrize("mode, instruct_text, seed", [
    ("cross_lingual", "", 41),
    ("instruct2", "Speak slowly, in a calm and friendly voice.", 42),
])
def test_other_modes_equal_the_library(cv_server, reference, mode, instruct_text, seed):
    wav = prompt_wav(4)
    text = "This request runs in another mode. It has two sentences."
    extra = {"instruct": instruct_text} if instruct_text else {}
    # No prompt_text: neither mode puts the prompt's transcript in the LLM prompt.
    values = synthesis_request(text, prompt_audio=wav, prompt_sample_rate=RATE, mode=mode, seed=seed, **extra).tensors()
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        got = waveforms(stream.infer("cosyvoice2", values))
    assert got
    want = reference.chunks(text, reference.voice(wav), seed=seed, mode=mode, instruct_text=instruct_text)
    assert_same_audio(got, want)
    zero_shot = reference.chunks(text, reference.voice(wav), seed=seed)
    assert [c.size for c in zero_shot] != [c.size for c in want] or not all(
        np.allclose(a, b, atol=ATOL) for a, b in zip(zero_shot, want))  # the mode changed the audio


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
    answer = http_infer(cv_server, "cosyvoice2_offline", synthesis_request(text, voice_id=voice_id, seed=5).tensors())
    (output,) = answer["outputs"]
    assert output["name"] == "waveform" and output["datatype"] == "FP32"
    waveform = np.asarray(output["data"], dtype=np.float32)
    want = np.concatenate(reference.chunks(text, reference.voice(wav), seed=5, stream=False))
    assert output["shape"] == [want.size]
    np.testing.assert_allclose(waveform, want, rtol=0, atol=ATOL)


ENCODER_RUNS = ("nv_inference_request_success", {"model": "prompt_encoder"})


def test_register_voice_is_idempotent_and_serves_by_id(cv_server, reference):
    wav = prompt_wav(5)
    runs = metric(cv_server, ENCODER_RUNS[0], **ENCODER_RUNS[1])
    voice_id = register(cv_server, wav, PROMPT_TEXT)
    wait_for_metric(cv_server.metrics_url, ENCODER_RUNS[0], lambda v: v == runs + 1, **ENCODER_RUNS[1])
    assert register(cv_server, wav, PROMPT_TEXT) == voice_id  # found in the store: no encoder run
    # The key is audio hash + transcript: the same recording with another transcript is another voice.
    assert register(cv_server, wav, "another transcript") != voice_id
    wait_for_metric(cv_server.metrics_url, ENCODER_RUNS[0], lambda v: v >= runs + 2, **ENCODER_RUNS[1])
    assert metric(cv_server, ENCODER_RUNS[0], **ENCODER_RUNS[1]) == runs + 2
    hits = metric(cv_server, "cosyvoice_voice_store_hits_total", model="cosyvoice2") + \
        metric(cv_server, "cosyvoice_voice_store_loads_total", model="cosyvoice2")
    text = "Synthesis by a registered voice id."
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        by_id = waveforms(stream.infer("cosyvoice2", synthesis_request(text, voice_id=voice_id, seed=3).tensors()))
        by_wav = waveforms(stream.infer("cosyvoice2", synthesis_request(text, prompt_audio=wav, prompt_sample_rate=RATE,
                                                                       prompt_text=PROMPT_TEXT, seed=3).tensors()))
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
    values = synthesis_request("Good input.", prompt_audio=prompt_wav(index), prompt_sample_rate=RATE,
                              prompt_text=PROMPT_TEXT, seed=1).tensors()
    values.update(override)
    return values


BAD_INPUTS = [
    ("empty text", lambda: _good(target_text=np.array([b"  "], dtype=object)), "target_text"),
    ("unknown voice", lambda: synthesis_request("Hi.", voice_id="no-such-voice").tensors(), "reference_audio_id"),
    ("corrupt audio file", lambda: synthesis_request("Hi.", prompt_text=PROMPT_TEXT,
                                                   prompt_audio=b"RIFF not audio").tensors(),
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
]


@pytest.mark.parametrize("case, values, field", BAD_INPUTS)
def test_bad_inputs_name_the_field(cv_server, case, values, field):
    message = _error_of(cv_server, values())
    assert field in message, f"{case}: {message}"


def test_register_voice_rejects_bad_audio(cv_server):
    message = _error_of(cv_server, {"reference_wav": np.zeros(RATE, np.float32),
                                    "reference_sample_rate": np.array([RATE], np.int32)}, model="register_voice")
    assert "reference_wav" in message and "silent" in message


def test_the_server_carries_on_after_bad_inputs(cv_server, reference):
    """Every bad input of BAD_INPUTS, then a good request: its audio is the library's."""
    for case, values, field in BAD_INPUTS:
        assert field in _error_of(cv_server, values()), case
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


# ---- restart and idle timeout ---------------------------------------------------------------------------

def test_a_registered_voice_survives_a_restart(cv_server):
    """Restarts the session's server (its voice store is a file of the session) and leaves it serving,
    warm, on new ports: tests read the server's URLs each time, so any test may come after this one."""
    wav = prompt_wav(6)
    voice_id = register(cv_server, wav, PROMPT_TEXT)
    values = synthesis_request("Still the same voice after a restart.", voice_id=voice_id, seed=9).tensors()
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        before = waveforms(stream.infer("cosyvoice2", values))
    try:
        assert cv_server.stop() == 0
    finally:
        cv_server.start()
        warm_up(cv_server)  # by recording: the voice store is not read
    assert metric(cv_server, "cosyvoice_voice_store_loads_total", model="cosyvoice2") == 0  # a new process
    with GrpcStream(cv_server.grpc_url, timeout_s=120) as stream:
        after = waveforms(stream.infer("cosyvoice2", values))
    assert_same_audio(after, before)
    assert metric(cv_server, "cosyvoice_voice_store_loads_total", model="cosyvoice2") == 1  # read from the file


IDLE_TIMEOUT_S = 1.0


@pytest.fixture
def t2w_server(tiny_model, tmp_path):
    """A server of token2wav alone (a split deployment's backend) that frees streams idle for 1 s."""
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    options = ServeOptions(model_dir=tiny_model, run_dir=tmp_path / "run", address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, voice_store=str(tmp_path / "voices.sqlite"),
                           role="backend", t2w_idle_timeout_s=IDLE_TIMEOUT_S, torch_threads=1)
    with prepare(options, binary=tritonserver_or_skip(), die_with_parent=True) as server:
        yield server


def test_token2wav_frees_a_stream_left_idle(t2w_server):
    """A first chunk sent straight to token2wav and never finalized: the server frees the stream after its
    idle timeout, and the metrics show it without any further request."""
    import torch
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from cosyvoice_triton.token2wav.stream import FlowPrompt
    from cosyvoice_triton.token2wav.scheduler import ChunkRequest
    from cosyvoice_triton.wire.stage_tensors import chunk_inputs

    generator = torch.Generator().manual_seed(0)
    prompt = FlowPrompt(torch.randint(0, 6561, (1, 20), dtype=torch.int32, generator=generator),
                        torch.randn(1, 40, 80, generator=generator), torch.randn(1, 192, generator=generator))
    url, labels = t2w_server.metrics_url, {"model": "token2wav"}
    assert metric(t2w_server, "cosyvoice_token2wav_streams_freed_total", **labels) == 0  # a fresh server
    with grpcclient.InferenceServerClient(t2w_server.grpc_url) as client:
        result = client.infer("token2wav", grpc_inputs(chunk_inputs(
            ChunkRequest("left-open", list(range(10, 40)), False, prompt, seed=0))))
        assert result.as_numpy("waveform").size > 0
        wait_for_metric(url, "cosyvoice_token2wav_streams_freed_total", lambda v: v == 1, reason="idle", **labels)
        assert metric(t2w_server, "cosyvoice_token2wav_active_streams", **labels) == 0
        # The state is gone: the stream's next chunk is refused, naming the field.
        with pytest.raises(InferenceServerException, match="stream_id"):
            client.infer("token2wav", grpc_inputs(chunk_inputs(
                ChunkRequest("left-open", list(range(40, 50)), False, None, None))))
