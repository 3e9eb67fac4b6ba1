"""`RecordedNoise`: a HiFT noise source (`models.hift_source.HiFTNoise`) that replays given draws, so the
golden tests can feed the vocoder the reference implementation's recorded randomness."""
from __future__ import annotations

import torch
from torch import Tensor


class RecordedNoise:
    """Replays three given tensors (draws recorded from the reference implementation), in float32 as the
    library's noise sources draw."""

    def __init__(self, initial_phase: Tensor, sine_noise: Tensor, source_noise: Tensor):
        self.draws = {"initial_phase": initial_phase, "sine_noise": sine_noise, "source_noise": source_noise}

    def _replay(self, name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
        draw = self.draws[name]
        if tuple(draw.shape) != tuple(shape):
            raise ValueError(f"recorded {name} has shape {tuple(draw.shape)}, the model asks for {tuple(shape)}")
        return draw.to(device=device, dtype=torch.float32)

    def initial_phase(self, batch: int, harmonics: int, device: torch.device) -> Tensor:
        return self._replay("initial_phase", (batch, harmonics), device)

    def sine_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        return self._replay("sine_noise", shape, device)

    def source_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        return self._replay("source_noise", shape, device)
