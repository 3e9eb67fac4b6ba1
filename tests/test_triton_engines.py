"""The engine switch on a real tritonserver: token2wav on ONNX Runtime, and TensorRT asked for where it
cannot run (no GPU, no tensorrt package), which must fall back to ONNX Runtime and still serve.

Both servers run every model of model_repository/ on a tiny random folder, started as `cosyvoice-triton
serve --engine ...` starts them (free ports, max_token_text_ratio 3 as in test_triton_serving.py). Their
streamed audio is compared with the library's in-process pipeline on torch (`Pipeline` over the
reference LLM and token2wav) for the same inputs and seed. Tolerance 1e-3 absolute, as the engine tests'
end-to-end waveforms: ONNX Runtime's graphs differ from torch by ~1e-6 on mels, which moves HiFT's F0 and
so its harmonic phase a little. Measured ~1e-5 here, where the tiny model's audio peaks at ~5e-2 and
another seed changes it by ~2e-2.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.client.triton_client import synthesis_request
from triton_harness import GrpcStream, tritonserver_or_skip

RATIO = 3.0
RATE = 16000
PROMPT_TEXT = "a short voice prompt"
TEXT = "Engines should not change what the server says. Not even a little."
SEED = 21
ATOL = 1e-3


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory) -> Path:
    """A tiny folder of its own: the servers export their graphs into `<model>/onnx`."""
    from cosyvoice_triton.random_folder.write import write_random_model

    return write_random_model(tmp_path_factory.mktemp("engines") / "model", size="tiny", seed=0)


def prepared(model_dir: Path, run_dir: Path, engine: str):
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    options = ServeOptions(model_dir=model_dir, run_dir=run_dir, address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, voice_store=str(run_dir / "voices.sqlite"),
                           max_token_text_ratio=RATIO, torch_threads=1, workers=2, engine=engine)
    return prepare(options, binary=tritonserver_or_skip(), die_with_parent=True)


@pytest.fixture(scope="module")
def servers(engine_model, tmp_path_factory) -> dict[str, object]:
    """Both servers, started side by side on one model folder: both find no graphs in `<model>/onnx` (the
    default folder) and one exports them while the other waits for it."""
    servers = {engine: prepared(engine_model, tmp_path_factory.mktemp(f"serve_{engine}"), engine)
               for engine in ("onnxruntime", "tensorrt")}
    with ThreadPoolExecutor(len(servers)) as pool:
        starts = [pool.submit(server.start) for server in servers.values()]
        wait(starts)  # both done (or failed) before any is stopped
        try:
            for started in starts:
                started.result()
            yield servers
        finally:
            list(pool.map(lambda server: server.stop(), servers.values()))


@pytest.fixture(scope="module")
def prompt() -> np.ndarray:
    return speech_like(1.5, RATE, seed=3, pitch_hz=110.0)


@pytest.fixture(scope="module")
def reference_chunks(engine_model, prompt) -> list[np.ndarray]:
    """The streamed chunks of the library's pipeline, all on torch."""
    import torch

    from cosyvoice_triton.messages import ChunkPolicy
    from cosyvoice_triton.pipeline.local_stages import ReferenceLLM, ReferenceToken2Wav
    from cosyvoice_triton.pipeline.pipeline import Pipeline
    from cosyvoice_triton.messages import SynthesisRequest
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tts = CosyVoice2.from_model_dir(engine_model)
        tts.llm.config.max_token_text_ratio = RATIO
        pipeline = Pipeline(tts.preprocessor, ReferenceLLM(tts.llm), ReferenceToken2Wav(tts.token2wav))
        request = SynthesisRequest(text=TEXT, voice=tts.encode_voice(prompt, RATE, PROMPT_TEXT), seed=SEED,
                                   sampling=tts.llm.config.sampling, chunk_policy=ChunkPolicy())
        return [chunk for chunk in pipeline.run(request, stream=True) if chunk.size]
    finally:
        torch.set_num_threads(threads)


def streamed(server, prompt: np.ndarray) -> list[np.ndarray]:
    values = synthesis_request(TEXT, prompt_audio=prompt, prompt_sample_rate=RATE, prompt_text=PROMPT_TEXT, seed=SEED).tensors()
    with GrpcStream(server.grpc_url, timeout_s=120) as stream:
        responses = stream.infer("cosyvoice2", values)
    errors = [r.error for r in responses if r.error]
    assert not errors, errors
    assert responses[-1].final
    return [r.outputs["waveform"] for r in responses if r.outputs.get("waveform") is not None
            and r.outputs["waveform"].size]


def assert_same_audio(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(want) >= 3  # a stream of several chunks, not one
    assert [c.size for c in got] == [c.size for c in want]
    got, want = np.concatenate(got), np.concatenate(want)
    print(f"max abs difference to the torch reference: {np.abs(got - want).max():.1e} (peak {np.abs(want).max():.2f})")
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def log_lines(server, pattern: str) -> list[str]:
    return [line for line in server.log_path.read_text(errors="replace").splitlines() if re.search(pattern, line)]


def test_onnxruntime_server_streams_the_torch_audio(servers, engine_model, prompt, reference_chunks):
    ort_server = servers["onnxruntime"]
    assert_same_audio(streamed(ort_server, prompt), reference_chunks)
    assert len(log_lines(ort_server, r"token2wav: .*token2wav on onnxruntime \(cpu\)")) == 1
    assert not log_lines(ort_server, r"is not available")


def test_the_graphs_are_exported_once_into_the_model_folder(servers, engine_model):
    exports = [line for server in servers.values()
               for line in log_lines(server, r"exporting the token2wav ONNX graphs of .* to .*/model/onnx")]
    assert len(exports) == 1, exports  # one server exported, the other waited for its graphs
    assert (engine_model / "onnx" / "manifest.json").exists()
    assert not list((engine_model / "onnx").glob("*.partial"))


def test_tensorrt_falls_back_once_and_still_serves(servers, prompt, reference_chunks):
    trt_server = servers["tensorrt"]
    token2wav = log_lines(trt_server, r"token2wav: .*engine 'tensorrt' is not available on cpu .*using 'onnxruntime'")
    campplus = log_lines(trt_server, r"speaker_embedding: .*CAM\+\+: engine 'tensorrt' is not available")
    assert len(token2wav) == 1 and len(campplus) == 1, log_lines(trt_server, r"not available")
    assert len(log_lines(trt_server, r"token2wav on onnxruntime \(cpu\)")) == 1
    assert_same_audio(streamed(trt_server, prompt), reference_chunks)
