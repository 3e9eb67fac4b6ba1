"""The knobs that speed and its benchmarks use, on one real tritonserver: `serve --llm-precision` reaches the
served `llm` model, perf's exact-length overlay (perf/exact_length.py) makes its streams exactly N tokens,
and `bench-official --triton` times that server.

The server runs every model on a tiny random folder, started as `python -m cosyvoice_triton.perf.exact_length
--exact-speech-tokens N --llm-precision int8` starts it. The llm model's log names what its backbone really
computes in (read from its modules, not from the flag) and the overlay's N; its streams are exactly N
tokens, the same as the library's reference decoding loop on an exact-length int8 LLM of the same folder;
and our side's timing entry, in-process and through this server, reports exactly N tokens of audio on both
paths.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from cosyvoice_triton.messages import LLMRequest, SamplingParams
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.perf import bench_official
from cosyvoice_triton.perf.exact_length import exact_length, exact_length_options
from cosyvoice_triton.random_folder.write import write_random_model
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.server.launcher import ServeOptions, prepare
from cosyvoice_triton.wire.stage_tensors import llm_inputs
from triton_harness import GrpcStream, tritonserver_or_skip

pytestmark = pytest.mark.timeout(900)

EXACT = 30  # speech tokens: more than the first chunk (25 + 3 lookahead)
REQUEST = LLMRequest(stream_id="precision", text_tokens=[5, 9, 11], prompt_text_tokens=[3, 4],
                     prompt_speech_tokens=[7, 8, 9, 10], sampling=SamplingParams(), seed=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("knobs") / "model", size="tiny", backbone_weights=False)


@pytest.fixture(scope="module")
def int8_server(model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve_int8")
    options = exact_length_options(ServeOptions(model_dir=model_dir, run_dir=run_dir, address="127.0.0.1",
                                                http_port=None, grpc_port=None, metrics_port=None,
                                                voice_store=str(run_dir / "voices.sqlite"), torch_threads=1,
                                                workers=2, llm_precision="int8"), EXACT)
    server = prepare(options, binary=tritonserver_or_skip(), die_with_parent=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_the_served_llm_runs_in_the_precision_asked_for(int8_server, model_dir) -> None:
    with GrpcStream(int8_server.grpc_url, timeout_s=120) as stream:
        responses = stream.infer("llm", llm_inputs(REQUEST))
    assert not [r.error for r in responses if r.error]
    served = [int(t) for r in responses if "speech_tokens" in r.outputs for t in r.outputs["speech_tokens"]]

    log = int8_server.log_path.read_text(errors="replace")
    match = re.search(r"llm: backbone int8 \(computes in (\w+); (\d+) int8 weight-only Linear layers\)", log)
    assert match, log[-2000:]
    assert int(match.group(2)) > 0
    assert f"llm: exactly {EXACT} speech tokens per stream" in log

    llm = exact_length(SpeechLM.from_model_dir(model_dir, max_seq_len=4096, precision="int8"), EXACT)
    ids = [torch.tensor([tokens], dtype=torch.int64)
           for tokens in (REQUEST.text_tokens, REQUEST.prompt_text_tokens, REQUEST.prompt_speech_tokens)]
    want = list(generate(llm, *ids, REQUEST.sampling, torch.Generator().manual_seed(REQUEST.seed)))
    assert len(served) == EXACT
    assert served == want


def test_our_side_alone_in_process_and_through_triton(int8_server, model_dir, capsys) -> None:
    url = int8_server.grpc_url.removeprefix("grpc://")
    bench_official.main(["--model-dir", str(model_dir), "--speech-tokens", str(EXACT), "--text-tokens", "6",
                         "--prompt-tokens", "20", "--concurrency", "1", "--repeats", "1", "--llm-precision", "int8",
                         "--triton", url, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert (result["speech_tokens"], result["prompt_tokens"], result["triton"]) == (EXACT, 20, url)
    [level] = result["levels"]
    for name in ("in_process", "triton", "triton_audio"):  # served: the voice by id, the prompt as audio
        timed = level["variants"][name]
        assert timed["audio_s"] == pytest.approx(EXACT / 25), name  # exactly N tokens on both paths
        assert 0 < timed["first_audio_s"] <= timed["total_s"], name
    ratio = level["ratios"]["triton / in_process"]["total_s"]
    assert ratio == pytest.approx(level["variants"]["triton"]["total_s"] / level["variants"]["in_process"]["total_s"])
