"""The excitation side of the HiFT vocoder: mel -> F0 -> harmonic-plus-noise source signal.

`F0Predictor` estimates one F0 value (Hz) per mel frame. `HarmonicSource` turns the F0 track into a
24 kHz excitation: sines at the fundamental and its overtones where the frame is voiced, Gaussian
noise where it is not, merged into one channel by a linear layer and tanh.

The source is the only random part of the vocoder. It takes its randomness from a `HiFTNoise`, which
makes three draws per call, in this order (the order of torch's global generator in the CosyVoice2
reference; CosyVoice3's vocoder instead slices tensors drawn once: `models/fixed_noise.py`):

1. `initial_phase(B, H)`: uniform [0, 1), a phase offset per harmonic in cycles (column 0 is ignored:
   the fundamental starts at phase 0);
2. `sine_noise((B, L, H))`: standard normal, added to the sines;
3. `source_noise((B, L, 1))`: standard normal for the noise branch, which inference does not use. It is
   drawn anyway so that a seeded generator moves through the same sequence as the reference.

`ZeroNoise` makes the vocoder deterministic (and silences the unvoiced excitation), `GeneratorNoise`
draws from a per-request `torch.Generator`, and `StackedNoise` gives each row of a batch its own source
(the golden tests replay the reference's recorded draws through a `HiFTNoise` of their own).
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_DRAW_DTYPE = torch.float32  # draws are made in fp32 whatever the model dtype, so seeds mean the same


class WeightNormedConv1d(nn.Conv1d):
    """A plain Conv1d whose checkpoint stores the weight weight-normed (g, v); it holds the folded weight."""


class WeightNormedConvTranspose1d(nn.ConvTranspose1d):
    """A plain ConvTranspose1d whose checkpoint stores the weight weight-normed; it holds the folded weight."""


WEIGHT_NORMED = (WeightNormedConv1d, WeightNormedConvTranspose1d)


# ---- noise sources -------------------------------------------------------------------------------

class HiFTNoise(Protocol):
    def initial_phase(self, batch: int, harmonics: int, device: torch.device) -> Tensor:
        """(B, H) uniform in [0, 1)."""

    def sine_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        """(B, L, H) added to the sines (standard normal; CosyVoice3's fixed noise is uniform in [0, 1))."""

    def source_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        """(B, L, 1) for the noise branch (standard normal)."""


class ZeroNoise:
    """No randomness at all: phase offsets and additive noise are zero."""

    def initial_phase(self, batch: int, harmonics: int, device: torch.device) -> Tensor:
        return torch.zeros((), dtype=_DRAW_DTYPE, device=device).expand(batch, harmonics)

    def sine_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        return torch.zeros((), dtype=_DRAW_DTYPE, device=device).expand(shape)

    def source_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        return torch.zeros((), dtype=_DRAW_DTYPE, device=device).expand(shape)


class GeneratorNoise:
    """Draws from one `torch.Generator`: seedable per request, and shared by nothing else.

    A CPU generator seeded with s gives the same draws as the reference after `torch.manual_seed(s)`.
    Draws are made on the generator's device and moved to the model's.
    """

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    @classmethod
    def seeded(cls, seed: int, device: str | torch.device = "cpu") -> "GeneratorNoise":
        return cls(torch.Generator(device=device).manual_seed(seed))

    def initial_phase(self, batch: int, harmonics: int, device: torch.device) -> Tensor:
        draw = torch.rand(batch, harmonics, generator=self.generator, dtype=_DRAW_DTYPE,
                          device=self.generator.device)
        return draw.to(device)

    def sine_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        # The reference fills a (B, L, H) view of a (B, H, L) buffer, and torch fills non-contiguous
        # tensors in another order (and consuming the stream differently) than contiguous ones.
        batch, length, harmonics = shape
        draw = torch.empty(batch, harmonics, length, dtype=_DRAW_DTYPE, device=self.generator.device)
        return draw.transpose(1, 2).normal_(generator=self.generator).to(device)  # (B, H, L) -> (B, L, H)

    def source_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        draw = torch.randn(shape, generator=self.generator, dtype=_DRAW_DTYPE, device=self.generator.device)
        return draw.to(device)


class ShiftedNoise:
    """A noise that is fixed per sample position (CosyVoice3's `FixedNoise`, `ZeroNoise`), read from sample
    `offset` on: the noise of a vocoder call on a later part of a signal. The phase offset belongs to the
    signal's sample 0, so a later part gets none. Not for noise drawn at each call (`GeneratorNoise`)."""

    def __init__(self, noise: HiFTNoise, offset: int):
        self.noise, self.offset = noise, offset

    def initial_phase(self, batch: int, harmonics: int, device: torch.device) -> Tensor:
        phase = self.noise.initial_phase(batch, harmonics, device)
        return phase if self.offset == 0 else torch.zeros_like(phase)

    def sine_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        batch, length, harmonics = shape
        return self.noise.sine_noise((batch, self.offset + length, harmonics), device)[:, self.offset:]

    def source_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        batch, length, channels = shape
        return self.noise.source_noise((batch, self.offset + length, channels), device)[:, self.offset:]


class StackedNoise:
    """One noise source per batch row, so batched streams keep their own (seeded) randomness."""

    def __init__(self, rows: Sequence[HiFTNoise]):
        self.rows = list(rows)

    def _check(self, batch: int) -> None:
        if batch != len(self.rows):
            raise ValueError(f"batch of {batch} rows but {len(self.rows)} noise sources")

    def initial_phase(self, batch: int, harmonics: int, device: torch.device) -> Tensor:
        self._check(batch)
        return torch.cat([row.initial_phase(1, harmonics, device) for row in self.rows])

    def sine_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        self._check(shape[0])
        return torch.cat([row.sine_noise((1, *shape[1:]), device) for row in self.rows])

    def source_noise(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        self._check(shape[0])
        return torch.cat([row.source_noise((1, *shape[1:]), device) for row in self.rows])


# ---- modules -------------------------------------------------------------------------------------

class F0Predictor(nn.Module):
    """Mel (B, n_mels, T) -> F0 in Hz (B, T): five conv+ELU layers and a linear read-out, made positive."""

    def __init__(self, in_channels: int, cond_channels: int, num_class: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [WeightNormedConv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)  # checkpoint names: condnet.{0,2,4,6,8}
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: Tensor) -> Tensor:
        hidden = self.condnet(mel)  # (B, C, T)
        hidden = hidden.transpose(1, 2)  # (B, C, T) -> (B, T, C) for the linear read-out
        return torch.abs(self.classifier(hidden).squeeze(-1))  # (B, T)


class HarmonicSource(nn.Module):
    """F0 per frame (B, T) -> excitation at the audio rate (B, 1, T * upsample), with L = T * upsample.

    The per-sample phase increment of each harmonic is averaged down to one value per frame (linear
    interpolation by 1/upsample), integrated, and brought back to the sample rate by `phase_upsampling`:
    "linear" keeps the phase smooth across frame boundaries (CosyVoice2); "nearest" (CosyVoice3's causal
    source, which must not look at the next frame) holds it constant over each frame, a staircase.
    """

    def __init__(self, sampling_rate: int, upsample: int, harmonics: int, sine_amp: float, noise_std: float,
                 voiced_threshold: float, phase_upsampling: str = "linear"):
        super().__init__()
        self.phase_upsampling = phase_upsampling
        self.sampling_rate = sampling_rate
        self.upsample = upsample
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(harmonics + 1, 1)  # checkpoint name; merges the harmonics into one channel
        self.register_buffer("harmonic_numbers", torch.arange(1, harmonics + 2, dtype=torch.float32)[None, None],
                             persistent=False)  # (1, 1, H): 1 for the fundamental, 2.. for the overtones

    def frame_cycles(self, f0: Tensor, noise: HiFTNoise) -> Tensor:
        """F0 (B, T) -> each harmonic's phase increment per frame, in cycles (B, T, H)."""
        dims = self.harmonic_numbers.shape[-1]
        f0 = f0.repeat_interleave(self.upsample, dim=1).unsqueeze(-1)  # (B, L, 1), held constant per frame
        cycles_per_sample = (f0 * self.harmonic_numbers / self.sampling_rate) % 1  # (B, L, H)

        phase_offset = noise.initial_phase(f0.shape[0], dims, f0.device).to(f0.dtype)  # (B, H)
        phase_offset = torch.cat([torch.zeros_like(phase_offset[:, :1]), phase_offset[:, 1:]], dim=1)
        cycles_per_sample = torch.cat([cycles_per_sample[:, :1] + phase_offset[:, None], cycles_per_sample[:, 1:]],
                                      dim=1)
        # (B, L, H) -> (B, H, L) to interpolate along time, and back
        return F.interpolate(cycles_per_sample.transpose(1, 2), scale_factor=1 / self.upsample,
                             mode="linear").transpose(1, 2)  # (B, T, H)

    def accumulated_cycles(self, f0: Tensor, noise: HiFTNoise, before: Tensor) -> Tensor:
        """The phase in cycles accumulated before each frame and after the last (B, T + 1, H), float64, from
        `before` (B, H) float64, the sum over earlier frames (zeros at the first frame of a signal).

        `forward` accumulates a whole signal's increments in one cumsum, which on the CPU sums float32 in a
        float64 accumulator; continuing that sum in float64 gives a later part of the signal the same
        float32 phase (`forward(..., cycles=...)`), so a stream may carry it instead of the whole F0."""
        increments = self.frame_cycles(f0, noise).double()  # (B, T, H)
        return torch.cumsum(torch.cat([before[:, None], increments], dim=1), dim=1)

    def forward(self, f0: Tensor, noise: HiFTNoise, cycles: Tensor | None = None) -> Tensor:
        """cycles: the phase accumulated through each frame (B, T, H) (`accumulated_cycles(...)[:, 1:]`);
        None: from the first frame."""
        batch, frames = f0.shape
        length = frames * self.upsample
        dims = self.harmonic_numbers.shape[-1]
        if cycles is None:
            cycles = torch.cumsum(self.frame_cycles(f0, noise), dim=1)  # (B, T, H)
        phase = cycles.to(f0.dtype) * 2 * math.pi  # (B, T, H), radians at frame rate
        f0 = f0.repeat_interleave(self.upsample, dim=1).unsqueeze(-1)  # (B, L, 1), held constant per frame
        # (B, T, H) -> (B, H, T) to interpolate along time; x upsample turns per-frame into per-sample phase
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample, scale_factor=float(self.upsample),
                              mode=self.phase_upsampling).transpose(1, 2)  # (B, L, H)
        sines = torch.sin(phase) * self.sine_amp

        voiced = (f0 > self.voiced_threshold).to(f0.dtype)  # (B, L, 1)
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        sines = sines * voiced + noise_amp * noise.sine_noise((batch, length, dims), f0.device).to(f0.dtype)
        excitation = torch.tanh(self.l_linear(sines))  # (B, L, 1)
        noise.source_noise((batch, length, 1), f0.device)  # unused noise branch; keeps the draw order
        return excitation.transpose(1, 2)  # (B, L, 1) -> (B, 1, L)
