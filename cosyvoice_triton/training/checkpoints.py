"""Training checkpoints (resume exactly where a run stopped) and averaging of the last N.

A checkpoint `step_00000120.pt` holds the step, the train module's state dict, the optimizer, the LR
schedule and the RNG states (torch's global generator and the training draws' generator), and is loaded
with `weights_only=True`.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

NAME = re.compile(r"step_(\d{8})\.pt$")


def checkpoint_path(folder: Path, step: int) -> Path:
    return folder / f"step_{step:08d}.pt"


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in `folder`, oldest step first."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if NAME.search(p.name)), key=lambda p: int(NAME.search(p.name)[1]))


def save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a run killed while saving leaves the previous checkpoint intact


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def average_state_dicts(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating-point tensors (in float64, cast back); others from the last state."""
    averaged = {}
    for key, last in states[-1].items():
        if last.is_floating_point():
            total = sum(state[key].double() for state in states)
            averaged[key] = (total / len(states)).to(last.dtype)
        else:
            averaged[key] = last.clone()
    return averaged
