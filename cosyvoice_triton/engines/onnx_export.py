"""Export the token2wav graphs of a model folder to ONNX (see `onnx_graphs.py` for what each graph is).

    python -m cosyvoice_triton.engines.onnx_export --model-dir DIR --out DIR [--verify]

writes `flow_encoder.onnx`, `flow_estimator.onnx`, `hift_decode.onnx` (opset 18, dynamic batch and time
axes, weight norm already folded at load) and `manifest.json`, which records the sha256 of `flow.pt` and
`hift.pt` they came from: `token2wav_onnx` exports again when the checkpoints change. Each graph is
checked with `onnx.checker` before it replaces an older file. `--verify` runs each graph in ONNX Runtime
(CPU) on example inputs and prints its max abs difference to torch.

The TorchScript-based exporter (`dynamo=False`) is used: it needs no package beyond torch and onnx.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn

from ..config import ModelPaths
from ..models.flow import FlowModel
from ..models.hift import HiFTGenerator
from .base import GraphSpec, sha256_file
from .onnx_graphs import HiFTDecodeGraph, example_inputs, token2wav_specs

log = logging.getLogger(__name__)

OPSET = 18
MANIFEST = "manifest.json"


def export_graph(module: nn.Module, spec: GraphSpec, inputs: tuple[torch.Tensor, ...], path: Path,
                 opset: int = OPSET) -> Path:
    """Trace `module` on `inputs` to `path` with the spec's names and dynamic axes; checked, then moved in place."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with torch.no_grad(), warnings.catch_warnings():
        # Known and harmless: the exporter is deprecated (see the module docstring) and cannot constant-fold
        # the negative-step Slice of the relative positions.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message="Constant folding - Only steps=1")
        torch.onnx.export(module.eval(), inputs, str(partial), dynamo=False, opset_version=opset,
                          input_names=list(spec.inputs), output_names=[spec.output],
                          dynamic_axes={name: dict(axes) for name, axes in spec.dynamic_axes.items()})
    onnx.checker.check_model(str(partial), full_check=True)  # by path: works past protobuf's 2 GB limit too
    os.replace(partial, path)
    return path


def _sources(model_dir: Path) -> dict[str, str]:
    paths = ModelPaths(model_dir)
    return {path.name: sha256_file(path) for path in (paths.flow, paths.hift)}


def export_token2wav(model_dir: str | Path, out_dir: str | Path, opset: int = OPSET) -> dict[str, Path]:
    """Export every token2wav graph of `model_dir` into `out_dir`; returns graph name -> ONNX path."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    flow = FlowModel.from_model_dir(model_dir)
    hift = HiFTGenerator.from_model_dir(model_dir)
    modules = {"flow_encoder": flow.encoder, "flow_estimator": flow.decoder.estimator,
               "hift_decode": HiFTDecodeGraph(hift)}
    paths = {}
    for name, spec in token2wav_specs(flow.config).items():
        inputs = example_inputs(name, flow.config, hift.config)
        paths[name] = export_graph(modules[name], spec, inputs, out_dir / f"{name}.onnx", opset)
        log.info("exported %s", paths[name])
    manifest = {"opset": opset, "torch": torch.__version__, "sources": _sources(model_dir),
                "graphs": {name: path.name for name, path in paths.items()}}
    partial = out_dir / f"{MANIFEST}.{os.getpid()}.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(partial, out_dir / MANIFEST)  # last: marks the set complete
    return paths


def _current_graphs(model_dir: Path, onnx_dir: Path) -> dict[str, Path] | None:
    """The graphs in `onnx_dir` if its manifest says they were made from `model_dir`'s checkpoints."""
    manifest_path = onnx_dir / MANIFEST
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    paths = {name: onnx_dir / file for name, file in manifest["graphs"].items()}
    if manifest["sources"] == _sources(model_dir) and all(path.exists() for path in paths.values()):
        return paths
    return None


def token2wav_onnx(model_dir: str | Path, onnx_dir: str | Path | None = None) -> dict[str, Path]:
    """The token2wav ONNX graphs of `model_dir` (default folder `<model_dir>/onnx`), exported first when
    they are missing or were made from other checkpoints. Processes that share the folder (servers
    started together on one model folder) export one at a time: the others wait and take the result."""
    model_dir = Path(model_dir)
    onnx_dir = Path(onnx_dir) if onnx_dir is not None else model_dir / "onnx"
    paths = _current_graphs(model_dir, onnx_dir)  # no lock needed (nor a writable folder) to read
    if paths is not None:
        return paths
    onnx_dir.mkdir(parents=True, exist_ok=True)
    with open(onnx_dir / ".export.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        paths = _current_graphs(model_dir, onnx_dir)
        if paths is not None:
            return paths
        log.info("exporting the token2wav ONNX graphs of %s to %s", model_dir, onnx_dir)
        return export_token2wav(model_dir, onnx_dir)


def verify_token2wav(model_dir: str | Path, paths: dict[str, Path], batch: int = 2,
                     frames: int = 46) -> dict[str, float]:
    """Max abs difference between ONNX Runtime (CPU) and torch per graph, on `example_inputs` of that size."""
    from .ort_runner import OrtRunner  # the exporter itself does not need onnxruntime
    from .torch_runner import TorchRunner

    flow = FlowModel.from_model_dir(model_dir)
    hift = HiFTGenerator.from_model_dir(model_dir)
    modules = {"flow_encoder": flow.encoder, "flow_estimator": flow.decoder.estimator, "hift_decode": hift.decode}
    errors = {}
    for name, spec in token2wav_specs(flow.config).items():
        inputs = example_inputs(name, flow.config, hift.config, batch, frames)
        expected = TorchRunner(modules[name], spec, "cpu")(*inputs)
        actual = OrtRunner(paths[name], spec, "cpu")(*inputs)
        errors[name] = float((actual - expected).abs().max())
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyvoice_triton.engines.onnx_export",
                                     description="export the token2wav graphs (flow encoder, flow estimator, "
                                                 "HiFT decode) of a model folder to ONNX")
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--opset", type=int, default=OPSET)
    parser.add_argument("--verify", action="store_true", help="compare each graph in ONNX Runtime with torch")
    args = parser.parse_args(argv)
    paths = export_token2wav(args.model_dir, args.out, args.opset)
    for name, path in paths.items():
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    if args.verify:
        for name, error in verify_token2wav(args.model_dir, paths).items():
            print(f"{name}: onnxruntime vs torch max abs error {error:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
