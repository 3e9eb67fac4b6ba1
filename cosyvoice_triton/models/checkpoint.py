"""Strict loading of a released checkpoint file, with errors that name the file."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cosyvoice_triton.errors import ModelFolderError


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of `path` (weights only, on the CPU); ModelFolderError when it is absent or unreadable."""
    if not path.is_file():
        raise ModelFolderError(f"{path} not found")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # a truncated or foreign file: say which one
        raise ModelFolderError(f"{path}: cannot be read as a state dict: {exc}") from exc


def load_state(module: nn.Module, path: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Load `path` (or its already read and converted `state`) into `module` with `strict=True`; a missing,
    unexpected or mis-shaped key is a ModelFolderError naming the file."""
    state = read_state(path) if state is None else state
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelFolderError(f"{path}: does not match the model its folder's yaml describes: {exc}") from exc
