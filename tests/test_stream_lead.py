"""On a real tritonserver (tiny random model) started with `chunk_policy=adaptive`: the cosyvoice2 model
observes each stream's lead at every chunk it sends, and follows the server's chunk policy (or the one a
request names). An adaptive stream's second hop stays 25 tokens (its first chunk leaves the listener too
little audio to cover a 2 s hop), where the fixed schedule doubles it to 50, whatever the load."""
from __future__ import annotations

import numpy as np
import pytest

from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.client.triton_client import synthesis_request
from triton_harness import GrpcStream, metric_value, scrape, tritonserver_or_skip, wait_for_metric

RATE = 16000
TEXT = ("This sentence is long enough for the speech model to make several chunks of audio, one after the "
        "other, while the listener plays them back without a pause.")
LEAD = "cosyvoice_stream_lead_seconds"


@pytest.fixture(scope="module")
def adaptive_server(tmp_path_factory):
    from cosyvoice_triton.random_folder.write import write_random_model
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    binary = tritonserver_or_skip()
    root = tmp_path_factory.mktemp("lead")
    model = write_random_model(root / "model", size="tiny", seed=0)
    options = ServeOptions(model_dir=model, run_dir=root / "run", address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, voice_store=str(root / "voices.sqlite"),
                           max_token_text_ratio=3.0, torch_threads=1, workers=4, chunk_policy="adaptive")
    server = prepare(options, binary=binary, die_with_parent=True)
    server.start()
    yield server
    server.stop()


def chunks(server, **extra) -> list[np.ndarray]:
    values = synthesis_request(TEXT, prompt_audio=speech_like(2.0, RATE, seed=3), prompt_sample_rate=RATE,
                              prompt_text="a short voice prompt", seed=5).tensors()
    values.update({k: np.array([v.encode()], dtype=object) for k, v in extra.items()})
    with GrpcStream(server.grpc_url, timeout_s=300) as stream:
        responses = stream.infer("cosyvoice2", values)
    errors = [r.error for r in responses if r.error]
    assert not errors, errors
    return [r.outputs["waveform"] for r in responses if "waveform" in r.outputs]


def test_lead_is_observed_at_every_chunk_and_the_server_policy_applies(adaptive_server):
    labels = {"model": "cosyvoice2"}
    before = metric_value(scrape(adaptive_server.metrics_url), LEAD + "_count", **labels) or 0.0
    adaptive = chunks(adaptive_server)
    assert len(adaptive) >= 3
    # one observation per chunk sent; the first chunk's lead is 0 (a bucket at 0 holds it)
    want = before + len(adaptive)
    wait_for_metric(adaptive_server.metrics_url, LEAD + "_count", lambda v: v is not None and v >= want, **labels)
    after = scrape(adaptive_server.metrics_url)
    assert metric_value(after, LEAD + "_count", **labels) == want
    assert metric_value(after, LEAD + "_bucket", le="+Inf", **labels) == want
    assert metric_value(after, LEAD + "_bucket", le="0", **labels) >= 1


def test_a_request_names_its_chunk_policy(adaptive_server):
    """The per-request `chunk_policy` input wins over the server's: the same seed and text cut by the
    fixed schedule (second hop 50 tokens) and by the server's adaptive one (25), the same audio in all;
    an unknown policy is refused naming the input."""
    adaptive = chunks(adaptive_server, chunk_policy="adaptive")
    fixed = chunks(adaptive_server, chunk_policy="fixed")
    assert len(fixed) >= 3 and adaptive[0].size == fixed[0].size and fixed[1].size == 2 * adaptive[1].size
    assert sum(c.size for c in fixed) == sum(c.size for c in adaptive)
    with pytest.raises(AssertionError, match="chunk_policy"):
        chunks(adaptive_server, chunk_policy="eager")
