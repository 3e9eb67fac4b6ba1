"""CosyVoice3's vocoder noise: drawn once, when the official model is built, never at inference.

The official causal sine generator draws three tensors at construction and slices them from sample 0 at
every call: a phase offset per harmonic `rand_ini` (1, 9), column 0 zeroed (it never reaches the output:
the phase is read at frame centres), the sine noise `sine_waves` (1, 7_200_000, 9) and the noise-branch
`uv` (1, 7_200_000, 1) (discarded by inference), all *uniform* in [0, 1). They come from torch's CPU
generator right after the flow's solver reseeds it with 0, following the draws of the modules built in
between (`cosyvoice3_draws`), so they are the same for every CosyVoice3 folder of the same dimensions.

`FixedNoise` replays them without keeping 300 s of noise: uniform draws fill memory in order, so the first
L samples of `sine_waves` are the first L * 9 draws after `rand_ini`. It draws a prefix when a longer one
is first asked for, under a lock, and keeps it; the values at every index are fixed, so nothing of one
request reaches another. It implements `hift_source.HiFTNoise`.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor

NOISE_SEED = 0  # the flow solver's reset (`CausalConditionalCFM.__init__`), whatever the yaml seeds
NOISE_SAMPLES = 300 * 24000  # what the official tensors cover: 300 s at 24 kHz
NOISE_HARMONICS = 9  # their columns, fixed in the official code (nb_harmonics 8 + the fundamental)
Draw = tuple[str, tuple[int, ...]]  # ("normal" | "uniform", shape)


def cosyvoice3_draws(mel_bins: int, noise_frames: int, vocab_size: int, token_dim: int, spk_embed_dim: int,
                     f0_in_channels: int, f0_cond_channels: int, f0_num_class: int) -> list[Draw]:
    """The generator's draws from the seed-0 reset to the vocoder's noise, in order: the flow's noise, the
    flow's token embedding and speaker projection, then the vocoder's F0 predictor (built before it)."""
    def linear_or_conv(weight: tuple[int, ...]) -> list[Draw]:  # kaiming-uniform weight, then uniform bias
        return [("uniform", weight), ("uniform", weight[:1])]

    f0_convs = [(f0_cond_channels, f0_in_channels, 4)] + [(f0_cond_channels, f0_cond_channels, 3)] * 4
    return [("normal", (1, mel_bins, noise_frames)), ("normal", (vocab_size, token_dim)),
            *linear_or_conv((mel_bins, spk_embed_dim)),
            *(draw for shape in f0_convs for draw in linear_or_conv(shape)),
            *linear_or_conv((f0_num_class, f0_cond_channels))]


def _generator_after(draws: list[Draw]) -> torch.Generator:
    generator = torch.Generator().manual_seed(NOISE_SEED)  # local: the global RNG is left alone
    for kind, shape in draws:
        if kind == "normal":
            torch.empty(shape).normal_(generator=generator)
        else:
            torch.empty(shape).uniform_(generator=generator)
    return generator


def _initial_phase(generator: torch.Generator) -> Tensor:
    phase = torch.rand(1, NOISE_HARMONICS, generator=generator)
    phase[:, 0] = 0  # the fundamental starts at phase 0
    return phase


def official_noise(draws: list[Draw], samples: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rand_ini (1, 9), sine_waves[:, :samples] (1, samples, 9), uv[:, :samples] (1, samples, 1)) as the
    official vocoder holds them. Draws all 300 s of sine noise to reach `uv` (~1 s, 260 MB while it runs)."""
    generator = _generator_after(draws)
    phase = _initial_phase(generator)
    sine = torch.rand(1, NOISE_SAMPLES, NOISE_HARMONICS, generator=generator)[:, :samples].clone()
    torch.empty(1, NOISE_HARMONICS).uniform_(generator=generator)  # `l_linear` (9 -> 1): weight
    torch.empty(1).uniform_(generator=generator)  # and bias
    return phase, sine, torch.rand(1, samples, 1, generator=generator)


class FixedNoise:
    """The official fixed noise, drawn as far as it is used (module docstring). Shared, read-only."""

    def __init__(self, draws: list[Draw]):
        self._generator = _generator_after(draws)
        self._initial = _initial_phase(self._generator)
        self._sine = torch.empty(1, 0, NOISE_HARMONICS)  # the prefix drawn so far
        self._lock = threading.Lock()

    def _sine_prefix(self, length: int) -> Tensor:
        sine = self._sine
        if sine.shape[1] >= length:
            return sine
        if length > NOISE_SAMPLES:
            raise ValueError(f"{length} samples exceed the {NOISE_SAMPLES} of the vocoder's fixed noise (300 s)")
        with self._lock:
            drawn = self._sine.shape[1]
            if drawn < length:
                target = min(NOISE_SAMPLES, max(length, 2 * drawn))  # grow geometrically: few redraws
                more = torch.rand(1, target - drawn, NOISE_HARMONICS, generator=self._generator)
                self._sine = torch.cat([self._sine, more], dim=1)  # a new tensor: readers keep the old one
            return self._sine

    def initial_phase(self, batch: int, harmonics: int, device: torch.device) -> Tensor:
        self._check(harmonics)
        return self._initial.to(device).expand(batch, harmonics)

    def sine_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        batch, length, harmonics = shape
        self._check(harmonics)
        return self._sine_prefix(length)[:, :length].to(device).expand(batch, length, harmonics)

    def source_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        """The noise branch, which inference discards: zeros (the official `uv` tensor: `official_noise`)."""
        return torch.zeros((), device=device).expand(shape)

    @staticmethod
    def _check(harmonics: int) -> None:
        if harmonics != NOISE_HARMONICS:
            raise ValueError(f"the fixed noise has {NOISE_HARMONICS} harmonics, the source {harmonics}")
