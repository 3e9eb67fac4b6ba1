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


@pytest.mark.parametrize("capability, has_bf16, has_vnni, device, llm, flow, cpu", [
    ("AVX512", True, True, "cpu", "int8", "bf16", "AVX512 with BF16"),  # AVX512-BF16 / AMX
    ("AVX512", False, True, "cpu", "int8-dynamic", "int8-dynamic", "AVX512 without BF16, with VNNI"),
    ("AVX512", False, False, "cpu", "int8-dynamic", "fp32", "AVX512 without BF16"),  # fbgemm native, no VNNI
    ("AVX2", False, True, "cpu", "int8-dynamic", "fp32", "AVX2 without BF16"),  # VNNI counts with AVX512 kernels
    ("DEFAULT", False, False, "cpu", "fp32", "fp32", "DEFAULT without BF16"),
    ("AVX2", False, False, "cuda", "bf16", "bf16", "AVX2 without BF16"),
])
def test_auto_follows_the_cpus_instructions_and_the_device(monkeypatch, capability, has_bf16, has_vnni, device, llm,
                                                           flow, cpu) -> None:
    monkeypatch.setattr(auto_precision, "cpu_has_bf16", lambda: has_bf16)
    monkeypatch.setattr(auto_precision, "_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: has_vnni, raising=False)
    assert auto_precision.resolve_llm_precision("auto", device) == llm
    assert auto_precision.resolve_flow_precision("auto", device) == flow
    assert auto_precision.resolve_llm_precision("fp32", device) == "fp32"  # a named precision is kept
    assert auto_precision.resolve_flow_precision("int8-dynamic", device) == "int8-dynamic"
    assert auto_precision.describe_cpu() == cpu
    assert auto_precision.resolved_precisions("auto", "auto", device) == {"llm": llm, "flow": flow, "cpu": cpu}


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
    assert rendered_parameter(repo, "token2wav", "flow_precision") == "bf16"
    assert rendered_parameter(repo, "llm", "core_share") == str(tmp_path / "run" / "core_share")
    assert precision_summary(repo) == "LLM int8, flow bf16 (CPU: %s)" % auto_precision.describe_cpu()
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


def test_the_cosyvoice3_flow_in_int8_dynamic_quantizes_its_dit_blocks(tmp_path) -> None:
    """The DiT's blocks (attention, feed-forward, their modulation) go int8 as the UNet's do; the input and
    output projections and the time embedding stay fp32; the mel moves, by little (tests/test_quality.py)."""
    from torch import nn

    from cosyvoice_triton.models.dit import DiTBlock
    from cosyvoice_triton.models.family import family_models
    from cosyvoice_triton.models.llm_precision import Int8DynamicLinear
    from cosyvoice_triton.random_folder.write import write_random_model

    folder = write_random_model(tmp_path / "cv3", size="tiny", seed=0, family="cosyvoice3")
    solver = family_models(folder).load_flow(folder).decoder
    in_blocks = sum(isinstance(m, nn.Linear) for block in solver.estimator.modules() if isinstance(block, DiTBlock)
                    for m in block.modules())
    total = sum(isinstance(m, nn.Linear) for m in solver.estimator.modules())
    inputs = (torch.randn(2, 80, 60, generator=torch.Generator().manual_seed(0)), torch.ones(2, 1, 60),
              torch.randn(2, 80, 60), torch.full((2,), 0.5), torch.randn(2, 80), torch.randn(2, 80, 60),
              torch.zeros(2, dtype=torch.bool))
    with torch.inference_mode():
        fp32 = solver.estimator(*inputs)
        solver.set_precision("int8-dynamic")
        int8 = solver.estimator(*inputs)
    assert sum(isinstance(m, Int8DynamicLinear) for m in solver.estimator.modules()) == in_blocks > 0
    assert sum(isinstance(m, nn.Linear) for m in solver.estimator.modules()) == total - in_blocks > 0
    assert not torch.equal(int8, fp32) and torch.allclose(int8, fp32, atol=0.1 * fp32.abs().max().item())

