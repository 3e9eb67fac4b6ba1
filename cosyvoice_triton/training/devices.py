"""Where a fine-tuning process runs: its rank under torchrun, its device, its autocast dtype."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cosyvoice_triton.errors import FinetuneError


@dataclass
class Distributed:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Distributed:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls()
        return cls(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world_size)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def pick_device(name: str, ddp: Distributed) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{ddp.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{ddp.local_rank}")
    return device


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast where the device supports it (auto: CUDA with bf16), else None (fp32)."""
    if precision == "fp32":
        return None
    supported = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())
    if precision == "bf16" and not supported:
        raise FinetuneError(f"--precision bf16: {device} does not support bfloat16")
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and supported else None
    return torch.bfloat16
