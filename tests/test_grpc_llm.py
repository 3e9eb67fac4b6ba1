"""cosyvoice2's LLM stage over its server's own gRPC endpoint (cosyvoice_triton/triton/grpc_llm.py), on a real
tritonserver (tiny model): why not BLS is in that module's docstring (a deadlock of Triton 2.51's Python backend).

- tritonserver's models are told the server's gRPC address (`COSYVOICE_SERVER_GRPC`), so cosyvoice2 takes the
  gRPC stage and never logs the BLS fallback's warning;
- a stream's tokens over gRPC equal the single-stream reference for the same request and seed;
- `cancel()` returns once the stream's LLM slot is free (the model's gauge says so right away), and the
  stream's id can be used again at once;
- bistream text appended over gRPC makes the same tokens as the reference bistream.
"""
from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from cosyvoice_triton.messages import LLMRequest
from cosyvoice_triton.prometheus_text import metric_sum
from cosyvoice_triton.triton.grpc_llm import SERVER_GRPC_ENV, GrpcLLM

from web.stack import RATIO, stub_pid, triton_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    with triton_server(tmp_path_factory.mktemp("grpc_llm"), tiny_model_dir) as (server, _, _):
        yield server


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from cosyvoice_triton.models.speech_lm import SpeechLM

    model = SpeechLM.from_model_dir(tiny_model_dir, max_batch=1, max_seq_len=1024)
    model.config.max_token_text_ratio = RATIO  # as the test server's llm
    return model


def request(llm, stream_id: str, text: list[int], seed: int, bistream: bool = False) -> LLMRequest:
    return LLMRequest(stream_id=stream_id, text_tokens=text, prompt_text_tokens=[5, 6, 7],
                      prompt_speech_tokens=list(range(40, 70)), sampling=llm.config.sampling, seed=seed,
                      bistream=bistream)


def reference_tokens(llm, req: LLMRequest, appended: list[int] = ()) -> list[int]:
    from cosyvoice_triton.pipeline.local_stages import ReferenceLLM

    stream = ReferenceLLM(llm).stream(req)
    if req.bistream:
        stream.append_text(list(appended), end=True)
    return [t for piece in stream for t in piece]


def llm_active(server) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        return metric_sum(response.read().decode(), "cosyvoice_llm_active_streams", "llm")


def test_the_models_are_told_the_servers_grpc_address(server):
    environ = Path(f"/proc/{stub_pid(server, 'cosyvoice2')}/environ").read_bytes().decode().split("\0")
    assert f"{SERVER_GRPC_ENV}={server.grpc_url}" in environ
    assert f"{SERVER_GRPC_ENV} is not set" not in server.log_path.read_text()


def test_tokens_over_grpc_equal_the_reference(server, llm):
    stage = GrpcLLM(server.grpc_url)
    try:
        for seed, text in ((1, [11, 12, 13, 14]), (2, [21, 22])):
            req = request(llm, f"grpc-llm-{seed}", text, seed)
            assert [t for piece in stage.stream(req) for t in piece] == reference_tokens(llm, req)
    finally:
        stage.close()


def test_cancel_returns_with_the_slot_free_and_the_id_usable_again(server, llm):
    stage = GrpcLLM(server.grpc_url)
    try:
        req = request(llm, "grpc-llm-cancel", list(range(30, 90)), seed=3)  # long: far from done when cancelled
        stream = stage.stream(req)
        next(iter(stream))
        stream.cancel()
        assert llm_active(server) == 0
        again = stage.stream(request(llm, "grpc-llm-cancel", [11, 12], seed=4))  # the same id, free again
        assert [t for piece in again for t in piece] == reference_tokens(llm, request(llm, "x", [11, 12], seed=4))
    finally:
        stage.close()


def test_bistream_text_appended_over_grpc_equals_the_reference(server, llm):
    stage = GrpcLLM(server.grpc_url)
    try:
        req = request(llm, "grpc-llm-bistream", [11, 12, 13], seed=5, bistream=True)
        stream = stage.stream(req)
        stream.append_text([14, 15, 16, 17, 18, 19], end=True)
        assert [t for piece in stream for t in piece] == reference_tokens(llm, req, [14, 15, 16, 17, 18, 19])
    finally:
        stage.close()
