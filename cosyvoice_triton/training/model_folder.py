"""The fine-tuned model folder: the base folder's files with `llm.pt` and/or `flow.pt` replaced.

Everything else is copied unchanged, except what is derived from the old weights and the fine-tuning
run's own folder. Derived: `onnx/` (the graphs and TensorRT plans this project exports, made again on first
use) and, beside a replaced `flow.pt` or `llm.pt`, the release's files named after it (`flow.*`, `llm.*`:
the estimator's ONNX export, TorchScript and TensorRT files, CosyVoice3's `llm.rl.pt`), which hold or stand
for the old weights; the official runtime would load them in place of the new ones. Each new state
dict must have exactly the keys, shapes and dtypes of the base file it replaces, so that the service loads
it with `strict=True`.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from cosyvoice_triton.config import ModelPaths

DERIVED = ("onnx",)  # made from the weights: never copied into a folder with new weights
RUN_FOLDER = "finetune"  # the run's features, checkpoints and logs, inside the output folder


def check_released_keys(new: dict[str, torch.Tensor], base: dict[str, torch.Tensor], name: str,
                        check_dtype: bool = True) -> None:
    if new.keys() != base.keys():
        extra, missing = sorted(new.keys() - base.keys()), sorted(base.keys() - new.keys())
        raise ValueError(f"{name}: keys differ from the base file (extra {extra[:5]}, missing {missing[:5]})")
    for key, tensor in base.items():
        if new[key].shape != tensor.shape or (check_dtype and new[key].dtype != tensor.dtype):
            raise ValueError(f"{name}: {key} is {tuple(new[key].shape)} {new[key].dtype}, "
                             f"the base has {tuple(tensor.shape)} {tensor.dtype}")


def made_from(name: str, replaced: set[str]) -> bool:
    """Whether the base folder's file `name` is a replaced weight file or made from one (`flow.*` beside a
    replaced `flow.pt`)."""
    return name in DERIVED or any(name == weights or name.startswith(weights.removesuffix(".pt") + ".")
                                  for weights in replaced)


def copy_base_files(base_dir: Path, out_dir: Path, replaced: set[str]) -> list[str]:
    """Copy the base folder into out_dir (existing files overwritten), leaving out replaced and derived files;
    returns the names of the derived files left out."""
    out_dir.mkdir(parents=True, exist_ok=True)
    left_out = []
    for item in base_dir.iterdir():
        if item.name == RUN_FOLDER or item.name in replaced:
            continue
        if made_from(item.name, replaced):
            left_out.append(item.name)
            continue
        target = out_dir / item.name
        if item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copy2(item, target)
    for name in DERIVED:
        shutil.rmtree(out_dir / name, ignore_errors=True)
    return sorted(left_out)


def write_model_folder(base_dir: Path, out_dir: Path, weights: dict[str, dict[str, torch.Tensor]]) -> Path:
    """`weights`: {"llm.pt": state dict, "flow.pt": state dict} (either or both). Returns out_dir."""
    base_paths = ModelPaths(base_dir)
    left_out = copy_base_files(base_dir, out_dir, set(weights))
    if left_out:
        print(f"not copied (made from the replaced weights): {', '.join(left_out)}", file=sys.stderr)
    for file_name, state in weights.items():
        base_state = torch.load(base_paths.root / file_name, map_location="cpu", weights_only=True)
        check_released_keys(state, base_state, file_name, check_dtype=False)
        # stored in the base file's dtypes (the model trains in fp32 whatever the file holds)
        state = {key: value.detach().to("cpu", base_state[key].dtype).contiguous() for key, value in state.items()}
        check_released_keys(state, base_state, file_name)
        tmp = out_dir / f"{file_name}.tmp"
        torch.save(state, tmp)
        tmp.replace(out_dir / file_name)
    return out_dir
