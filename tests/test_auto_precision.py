"""`auto` precision (models/auto_precision.py) and the flow estimator in int8-dynamic (models/flow.py): the choice
per CPU kind and device, where it is resolved and reported, the quantized layers. Each precision's quality
against fp32: tests/test_quality.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosyvoice_triton.models import auto_precision
from cosyvoice_triton.server.launcher import ServeOptions, precision_summary, render_run_repository, rendered_parameter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from cosyvoice_triton.random_folder.write import write_random_model

    return write_random_model(tmp_path_factory.mktemp("auto") / "tiny", size="tiny", seed=0)


@pytest.mark.parametrize("capability, has_bf16, device, llm, flow", [
    ("AVX512", True, "cpu", "int8", "fp32"),  # AVX512-BF16 / AMX: weight-only int8 in bf16; a bf16 flow misses
    ("AVX512", False, "cpu", "int8-dynamic", "fp32"),  # AVX512 without BF16: bf16 emulated, fbgemm native
    ("AVX2", False, "cpu", "int8-dynamic", "fp32"),  # AVX2: fbgemm's dynamic int8 step beats fp32's
    ("DEFAULT", False, "cpu", "fp32", "fp32"),
    ("AVX2", False, "cuda", "bf16", "fp32"),
])
def test_auto_follows_the_cpus_instructions_and_the_device(monkeypatch, capability, has_bf16, device, llm,
                                                           flow) -> None:
    monkeypatch.setattr(auto_precision, "cpu_has_bf16", lambda: has_bf16)
    monkeypatch.setattr(auto_precision, "_capability", lambda: capability)
    assert auto_precision.resolve_llm_precision("auto", device) == llm
    assert auto_precision.resolve_flow_precision("auto", device) == flow
    assert auto_precision.resolve_llm_precision("fp32", device) == "fp32"  # a named precision is kept
    assert auto_precision.resolve_flow_precision("bf16", device) == "bf16"
    assert auto_precision.describe_cpu() == f"{capability} {'with' if has_bf16 else 'without'} BF16"
    assert auto_precision.resolved_precisions("auto", "auto", device) == \
        {"llm": llm, "flow": flow, "cpu": auto_precision.describe_cpu()}


def test_bf16_counts_as_native_only_where_atens_kernels_may_use_avx512(monkeypatch) -> None:
    """ATEN_CPU_CAPABILITY=avx2 (how perf/ measures an AVX2 CPU on an AVX512 one) turns bf16 off for auto."""
    from cosyvoice_triton.models import llm_precision

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not llm_precision.cpu_has_bf16()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert llm_precision.cpu_has_bf16()


def test_the_launcher_writes_the_resolved_precisions_and_serve_reports_them(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(auto_precision, "cpu_has_bf16", lambda: True)
    options = ServeOptions(llm_precision="auto", flow_precision="auto")
    repo = render_run_repository(options, tmp_path / "model", "v.sqlite", tmp_path / "run" / "repo")
    assert rendered_parameter(repo, "llm", "precision") == "int8"
    assert rendered_parameter(repo, "token2wav", "flow_precision") == "fp32"
    assert rendered_parameter(repo, "llm", "core_share") == str(tmp_path / "run" / "core_share")
    assert precision_summary(repo) == "LLM int8, flow fp32 (CPU: %s)" % auto_precision.describe_cpu()
    monkeypatch.setattr(auto_precision, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(auto_precision, "_capability", lambda: "AVX2")
    repo = render_run_repository(options, tmp_path / "model", "v.sqlite", tmp_path / "run2" / "repo")
    assert (rendered_parameter(repo, "llm", "precision"), rendered_parameter(repo, "token2wav", "flow_precision")) \
        == ("int8-dynamic", "fp32")


def test_serve_and_up_default_to_auto() -> None:
    from cosyvoice_triton.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.llm_precision, args.flow_precision) == ("auto", "auto")
    import argparse

    from cosyvoice_triton.gateway.up import add_up_arguments

    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    args = parser.parse_args([])
    assert (args.llm_precision, args.flow_precision) == ("auto", "auto")


def test_the_flow_in_int8_dynamic_quantizes_its_transformer_blocks_each_row_on_its_own(tiny) -> None:
    """int8-dynamic replaces exactly the transformer blocks' Linear layers, once; a row's products do not depend
    on its batch (a loud neighbour would coarsen a shared activation scale)."""
    from torch import nn

    from cosyvoice_triton.models.flow import FlowModel
    from cosyvoice_triton.models.flow_estimator import TransformerBlock
    from cosyvoice_triton.models.llm_precision import Int8DynamicLinear

    solver = FlowModel.from_model_dir(tiny).decoder
    blocks = [m for m in solver.estimator.modules() if isinstance(m, TransformerBlock)]
    in_blocks = sum(isinstance(m, nn.Linear) for block in blocks for m in block.modules())
    outside = sum(isinstance(m, nn.Linear) for m in solver.estimator.modules()) - in_blocks
    solver.set_precision("int8-dynamic")
    assert sum(isinstance(m, Int8DynamicLinear) for m in solver.estimator.modules()) == in_blocks > 0
    assert sum(isinstance(m, nn.Linear) for m in solver.estimator.modules()) == outside  # time embedding: fp32
    with pytest.raises(RuntimeError, match="already quantized"):
        solver.set_precision("fp32")
    linear, width = blocks[0].ff.net[2], 4 * blocks[0].norm3.normalized_shape[0]  # feed-forward out: 4C -> C
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 40, width, generator=generator)
    rows[1] *= 50.0  # the neighbour
    with torch.inference_mode():
        assert torch.equal(linear(rows)[:1], linear(rows[:1]))

