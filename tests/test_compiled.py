"""Compiled hot loops (models/compiled.py): compiled blocks equal eager, compile once per shape bucket, fall
back to eager with one log line, and the `compile` setting reaches both the Triton configs and the in-process
pipeline.

On the tiny golden folder. Tolerances (max abs difference from eager, fp32): the compiled blocks reorder float
sums (fused norms and activations), so they are close, not bit-equal. Compilation is slow on 2 cores: each
test compiles a few small graphs, and inductor's cache goes to a folder of this test run.
"""
from __future__ import annotations

import logging

import pytest
import torch

from cosyvoice_triton.models import compiled
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.flow_cache import StreamFlowCache, cached_mel
from cosyvoice_triton.models.flow_estimator import TransformerBlock
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.server.launcher import ServeOptions, render_run_repository, rendered_parameter
from test_flow_cache import flow_inputs, prompt_slice, speech_tokens

MEL_ATOL = 1e-4  # flow mel after 10 Euler steps; measured ~2e-6 on the tiny folder
LOGIT_ATOL = 1e-4  # LLM decode logits
WAVE_ATOL = 1e-4  # HiFT waveform


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(compiled.CACHE_ENV, str(tmp_path_factory.mktemp("inductor")))
        yield


def new_graphs(before: int) -> int:
    return compiled.graphs() - before


def mel_of(flow: FlowModel, golden: dict, tokens: int, streaming: bool) -> torch.Tensor:
    inputs = flow_inputs([prompt_slice(golden, 0, 12)], [speech_tokens(tokens, tokens)])
    return flow.inference(**inputs, streaming=streaming, finalize=not streaming)


def cached_chunks(flow: FlowModel, golden: dict) -> list[torch.Tensor]:
    """Two cached streaming calls of one stream: an empty cache, then one of the first call's final frames."""
    prompt, tokens, cache, mels = prompt_slice(golden, 0, 20), speech_tokens(100, 5), StreamFlowCache(), []
    for end in (53, 78):
        c = flow.conditions(**flow_inputs([prompt], [tokens[:end]]), streaming=True, finalize=False)
        mel, _, (cache,), _ = cached_mel(flow, c, [cache], [10 ** 6], 10 ** 6)
        mels.append(mel)
    assert cache.frames > 0
    return mels


def test_flow_estimator_compiled_equals_eager_and_compiles_once_per_bucket(golden_model_dir, golden) -> None:
    eager, flow = FlowModel.from_model_dir(golden_model_dir), FlowModel.from_model_dir(golden_model_dir)
    assert compiled.compile_flow(flow) == sum(isinstance(m, TransformerBlock) for m in flow.modules())
    before = compiled.graphs()
    for tokens, streaming in ((40, True), (40, False)):  # the full pass's graph, once
        got, want = mel_of(flow, golden, tokens, streaming), mel_of(eager, golden, tokens, streaming)
        assert float((got - want).abs().max()) <= MEL_ATOL
    for got, want in zip(cached_chunks(flow, golden), cached_chunks(eager, golden)):  # the cached pass's two
        assert float((got - want).abs().max()) <= MEL_ATOL
    compiled_graphs = new_graphs(before)
    assert 1 <= compiled_graphs <= 3
    before = compiled.graphs()
    for tokens in (25, 61):  # other frame counts: the same buckets
        got, want = mel_of(flow, golden, tokens, True), mel_of(eager, golden, tokens, True)
        assert float((got - want).abs().max()) <= MEL_ATOL
    cached_chunks(flow, golden)
    assert new_graphs(before) == 0
    assert flow.state_dict().keys() == eager.state_dict().keys()  # compiling changes no parameter


def test_llm_decode_step_compiled_equals_eager_across_rows_and_cache_lengths(golden_model_dir) -> None:
    eager = SpeechLM.from_model_dir(golden_model_dir, max_batch=3, max_seq_len=512)
    llm = SpeechLM.from_model_dir(golden_model_dir, max_batch=3, max_seq_len=512)
    assert compiled.compile_llm(llm) == llm.config.qwen.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, 30, llm.config.llm_input_size, generator=g)

    def decode(model: SpeechLM, rows: int, position: int) -> torch.Tensor:
        slots = torch.arange(rows)
        for slot in range(rows):  # a prefill per slot (eager: not a hot loop), then positions up to `position`
            model.step_logits(prompt, torch.arange(30)[None], slots[slot:slot + 1], 128)
        tokens = torch.randint(0, 100, (rows, 1), generator=torch.Generator().manual_seed(rows))
        for pos in range(30, position + 1):
            logits = model.step_logits(model.embed_speech(tokens), torch.full((rows, 1), pos), slots,
                                       -(-(pos + 1) // 128) * 128)
        return logits

    before = compiled.graphs()
    for rows, position in ((1, 31), (2, 31)):
        assert float((decode(llm, rows, position) - decode(eager, rows, position)).abs().max()) <= LOGIT_ATOL
    assert 1 <= new_graphs(before) <= 2  # one row, several rows
    before = compiled.graphs()
    got, want = decode(llm, 3, 130), decode(eager, 3, 130)  # three rows; the cache span grows 128 -> 256
    assert float((got - want).abs().max()) <= LOGIT_ATOL
    assert new_graphs(before) == 0


def test_hift_compiled_at_load_equals_eager_for_any_frame_count_and_rows(golden_model_dir) -> None:
    """apply_compile's warm-up builds every graph: no call after it compiles."""
    eager, hift = HiFTGenerator.from_model_dir(golden_model_dir), HiFTGenerator.from_model_dir(golden_model_dir)
    assert compiled.apply_compile("on", "cpu", hift=hift) == ("hift",)
    g = torch.Generator().manual_seed(0)
    before = compiled.graphs()
    for rows, frames in ((1, 20), (1, 33), (2, 27)):
        mel = torch.randn(rows, 80, frames, generator=g)
        (got, _), (want, _) = hift.inference(mel, None, ZeroNoise()), eager.inference(mel, None, ZeroNoise())
        assert float((got - want).abs().max()) <= WAVE_ATOL
    assert new_graphs(before) == 0


def test_a_failed_compile_logs_one_line_and_runs_eager(golden_model_dir, caplog) -> None:
    flow = FlowModel.from_model_dir(golden_model_dir)
    block = next(m for m in flow.modules() if isinstance(m, TransformerBlock))
    forward = compiled.CompiledForward(TransformerBlock.forward, "a test block", {0: (1,)})

    def broken(*args):
        raise RuntimeError("forced: no C++ compiler\nsecond line")

    forward._compiled = broken  # as inductor failing at its first call
    forward.wrap(block)
    x, bias = torch.randn(2, 7, block.norm1.normalized_shape[0]), torch.zeros(2, 1, 7, 7)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__), torch.inference_mode():
        outs = [block(x, bias) for _ in range(3)]
        with pytest.raises(RuntimeError):  # an input eager rejects too: its own error, not the fallback's
            block(x[:, :, :3], bias)
    want = TransformerBlock.forward(block, x, bias)
    assert all(torch.equal(out, want) for out in outs)
    assert forward.failed
    assert [r.getMessage() for r in caplog.records] == [
        "torch.compile of a test block failed, running it eager: RuntimeError: forced: no C++ compiler"]


def test_an_input_error_does_not_turn_compile_off(golden_model_dir) -> None:
    block = next(m for m in FlowModel.from_model_dir(golden_model_dir).modules() if isinstance(m, TransformerBlock))
    forward = compiled.CompiledForward(TransformerBlock.forward, "a test block", {})
    forward._compiled = lambda module, x, bias: TransformerBlock.forward(module, x, bias)
    forward.wrap(block)
    with pytest.raises(RuntimeError), torch.inference_mode():
        block(torch.randn(1, 3, 5), torch.zeros(1, 1, 3, 3))  # wrong width: eager raises as well
    assert not forward.failed


def test_unsupported_platform_runs_eager_with_one_line(golden_model_dir, monkeypatch, caplog) -> None:
    monkeypatch.setattr(compiled, "unsupported_reason", lambda: "no inductor here")
    hift = HiFTGenerator.from_model_dir(golden_model_dir)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        assert compiled.apply_compile("on", "cpu", hift=hift) == ()
    assert [r.getMessage() for r in caplog.records] == ["compile on: running hift eager: no inductor here"]
    assert all("forward" not in m.__dict__ for m in hift.modules())


def test_settings_resolve_per_module_and_reach_the_configs(monkeypatch, tmp_path) -> None:
    assert compiled.compiled_modules("off", "cpu") == ()
    assert compiled.compiled_modules("on", "cpu") == compiled.COMPILED_MODULES
    monkeypatch.setitem(compiled.AUTO_MODULES, "cpu", frozenset({"hift"}))
    assert compiled.compiled_modules("auto", "cpu") == ("hift",)
    assert compiled.apply_compile("auto", "cpu", llm=None, flow=None) == ()  # hift not given: nothing to do
    with pytest.raises(ValueError):
        compiled.check_compile_setting("fast")
    repo = render_run_repository(ServeOptions(compile="on"), tmp_path / "model", "v.sqlite", tmp_path / "repo")
    assert rendered_parameter(repo, "llm", "compile") == rendered_parameter(repo, "token2wav", "compile") == "on"
    from cosyvoice_triton.cli import build_parser
    assert build_parser().parse_args(["serve", "--compile", "off"]).compile == "off"


def test_the_disk_cache_defaults_under_cosyvoice_home(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(compiled.CACHE_ENV, raising=False)
    monkeypatch.setenv("COSYVOICE_HOME", str(tmp_path))
    assert compiled.use_disk_cache() == tmp_path / "inductor" and (tmp_path / "inductor").is_dir()
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "mine"))
    assert compiled.use_disk_cache() == tmp_path / "mine"  # the environment's choice wins
