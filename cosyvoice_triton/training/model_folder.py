"""The fine-tuned model folder: the base folder's files with `llm.pt` and/or `flow.pt` replaced.

Everything else is copied unchanged, except what is derived from the old weights (`onnx/`: exported
graphs and TensorRT plans, made again on first use) and the fine-tuning run's own folder. Each new state
dict must have exactly the keys, shapes and dtypes of the base file it replaces, so that the service loads
it with `strict=True`.
"""
from __future__ import annotations

import shutil
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


def copy_base_files(base_dir: Path, out_dir: Path, replaced: set[str]) -> None:
    """Copy the base folder into out_dir (existing files overwritten), leaving out replaced and derived files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in base_dir.iterdir():
        if item.name in replaced or item.name in DERIVED or item.name == RUN_FOLDER:
            continue
        target = out_dir / item.name
        if item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copy2(item, target)
    for name in DERIVED:
        shutil.rmtree(out_dir / name, ignore_errors=True)


def write_model_folder(base_dir: Path, out_dir: Path, weights: dict[str, dict[str, torch.Tensor]]) -> Path:
    """`weights`: {"llm.pt": state dict, "flow.pt": state dict} (either or both). Returns out_dir."""
    base_paths = ModelPaths(base_dir)
    copy_base_files(base_dir, out_dir, set(weights))
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
