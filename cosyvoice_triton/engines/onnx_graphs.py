"""The graphs that leave torch: what each one takes and gives, and the modules that are exported.

token2wav runs three graphs; CAM++ ships as ONNX already (all f32 unless said otherwise):

- `flow_encoder`: x (B, W, 512), lengths (B,) i64, context_lengths (B,) i64, streaming (B,) bool
  -> h (B, 2 (W - 3), 512)
- `flow_estimator`: x, mu, cond (B, 80, T), mask (B, 1, T), t (B,), spks (B, 80), streaming (B,) bool
  -> velocity (B, 80, T)
- `hift_decode`: mel (B, 80, T), source (B, 1, L = 480 T) -> audio (B, L)
- `campplus`: input (B, T, 80) fbank -> output (B, 192)

`flow_encoder` is `FlowModel.encoder` as it is: the look-ahead tokens ride at the end of `x`
(`context_lengths` says how many are real) and `streaming` switches the chunk masks per row.
`flow_estimator` is one Euler step of `FlowMatching` on the 2N rows of a guided batch; the loop, the
schedule and the guidance mix stay in torch, so they are the same for every engine.

HiFT is split. `HiFTGenerator.inference` = F0 predictor -> harmonic source -> `decode(mel, source)`.
The source draws each request's noise from its own generator (see `models/hift_source.py`), so it stays
in torch; `decode` is deterministic and is exported as `HiFTDecodeGraph`, which computes the STFT of
the source and the iSTFT of the output as convolutions with fixed DFT bases: ONNX has no iSTFT and
TensorRT has no complex tensors.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.flow import FlowConfig
from ..models.hift import HiFTConfig, HiFTGenerator
from .base import GraphSpec, Shapes

CAMPPLUS_EMBEDDING_DIM = 192


def flow_estimator_spec() -> GraphSpec:
    batch_time = {0: "B", 2: "T"}
    return GraphSpec(
        name="flow_estimator", inputs=("x", "mask", "mu", "t", "spks", "cond", "streaming"), output="velocity",
        dynamic_axes={"x": batch_time, "mask": batch_time, "mu": batch_time, "t": {0: "B"}, "spks": {0: "B"},
                      "cond": batch_time, "streaming": {0: "B"}, "velocity": batch_time},
        output_shape=lambda shapes: tuple(shapes[0]))


def flow_encoder_spec(config: FlowConfig) -> GraphSpec:
    enc = config.encoder

    def output_shape(shapes: Shapes) -> tuple[int, ...]:
        batch, width, _ = shapes[0]
        return batch, enc.upsample_stride * (width - enc.pre_lookahead_len), enc.output_size

    return GraphSpec(
        name="flow_encoder", inputs=("x", "lengths", "context_lengths", "streaming"), output="h",
        dynamic_axes={"x": {0: "B", 1: "W"}, "lengths": {0: "B"}, "context_lengths": {0: "B"},
                      "streaming": {0: "B"}, "h": {0: "B", 1: "T_mel"}},
        output_shape=output_shape)


def hift_decode_spec() -> GraphSpec:
    return GraphSpec(
        name="hift_decode", inputs=("mel", "source"), output="audio",
        dynamic_axes={"mel": {0: "B", 2: "T"}, "source": {0: "B", 2: "L"}, "audio": {0: "B", 1: "L"}},
        output_shape=lambda shapes: (shapes[1][0], shapes[1][2]))


def campplus_spec() -> GraphSpec:
    """The released `campplus.onnx` (and its stand-in): fbank frames -> speaker embedding."""
    return GraphSpec(
        name="campplus", inputs=("input",), output="output",
        dynamic_axes={"input": {0: "B", 1: "T"}, "output": {0: "B"}},
        output_shape=lambda shapes: (shapes[0][0], CAMPPLUS_EMBEDDING_DIM))


def token2wav_specs(config: FlowConfig) -> dict[str, GraphSpec]:
    specs = [flow_encoder_spec(config), flow_estimator_spec(), hift_decode_spec()]
    return {spec.name: spec for spec in specs}


class HiFTDecodeGraph(nn.Module):
    """`HiFTGenerator.decode(mel, source) -> audio` with real-valued STFT / iSTFT (equal up to rounding).

    The network between the two transforms is the generator's own modules, called in the same order as
    in `decode`; `tests/test_engines_onnx.py` checks the two against each other.
    """

    def __init__(self, hift: HiFTGenerator):
        super().__init__()
        self.hift = hift
        c = hift.config
        n_fft, bins = c.n_fft, c.spec_bins
        assert n_fft % 2 == 0, f"n_fft {n_fft}: the one-sided inverse below assumes a Nyquist bin"
        window = hift.stft_window.double().cpu()  # (n_fft,) periodic Hann, as `decode` uses
        angle = 2 * math.pi * torch.outer(torch.arange(bins), torch.arange(n_fft)).double() / n_fft  # (F, n_fft)
        # STFT: X_k = sum_n w[n] x[n] exp(-i angle): rows 0..F-1 give the real parts, F..2F-1 the imaginary.
        analysis = torch.cat([window * angle.cos(), -window * angle.sin()])  # (2F, n_fft)
        # One-sided inverse DFT (bins 1..F-2 stand for their mirror images too, so they count twice),
        # then the synthesis window: frame[n] = w[n] / N * sum_k c_k (Re X_k cos - Im X_k sin).
        twice = torch.full((bins, 1), 2.0, dtype=torch.float64)
        twice[0] = twice[-1] = 1.0
        synthesis = torch.cat([twice * angle.cos(), -twice * angle.sin()]) * window / n_fft  # (2F, n_fft)
        device = hift.stft_window.device
        self.register_buffer("analysis", analysis.float()[:, None, :].to(device), persistent=False)  # (2F, 1, n_fft)
        self.register_buffer("synthesis", synthesis.float()[:, None, :].to(device), persistent=False)  # (2F, 1, n_fft)
        self.register_buffer("window_sq", (window ** 2).float()[None, None, :].to(device),
                             persistent=False)  # (1, 1, n_fft)

    def stft(self, signal: Tensor) -> Tensor:
        """(B, 1, L) -> (B, 2F, L / hop + 1): centred frames (reflect padding), real parts then imaginary."""
        c = self.hift.config
        padded = F.pad(signal, (c.n_fft // 2, c.n_fft // 2), mode="reflect")
        return F.conv1d(padded, self.analysis, stride=c.hop_len)

    def istft(self, spec: Tensor) -> Tensor:
        """(B, 2F, frames) -> (B, (frames - 1) * hop): overlap-add of windowed frames over the window power."""
        c = self.hift.config
        frames = F.conv_transpose1d(spec, self.synthesis, stride=c.hop_len)  # (B, 1, (frames-1)*hop + n_fft)
        envelope = F.conv_transpose1d(torch.ones_like(spec[:1, :1]), self.window_sq, stride=c.hop_len)
        half = c.n_fft // 2
        return (frames / envelope)[:, 0, half:-half]  # drop the centring padding

    def forward(self, mel: Tensor, source: Tensor) -> Tensor:
        """mel (B, n_mels, T), source (B, 1, L) -> audio (B, L)."""
        hift, c = self.hift, self.hift.config
        source_spec = self.stft(source)  # (B, 2F, frames)
        x = hift.conv_pre(mel)  # (B, base, T)
        kernels = len(c.resblock_kernel_sizes)
        for i, up in enumerate(hift.ups):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == len(hift.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + hift.source_resblocks[i](hift.source_downs[i](source_spec))
            stage = hift.resblocks[i * kernels](x)
            for j in range(1, kernels):
                stage = stage + hift.resblocks[i * kernels + j](x)
            x = stage / kernels
        x = hift.conv_post(F.leaky_relu(x))  # (B, 2F, frames)
        magnitude = torch.exp(x[:, :c.spec_bins]).clamp(max=1e2)
        phase = torch.sin(x[:, c.spec_bins:])
        spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)  # (B, 2F, frames)
        return self.istft(spec).clamp(-c.audio_limit, c.audio_limit)


def example_inputs(name: str, config: FlowConfig, hift: HiFTConfig, batch: int = 2, frames: int = 46
                   ) -> tuple[Tensor, ...]:
    """Inputs for graph `name`: `batch` rows, streaming and not in turn, all rows but the first padded.

    Used to trace the export and to compare engines; mel frames are log-mel-like (around -5)."""
    generator = torch.Generator().manual_seed(0)
    streaming = torch.tensor([True, False]).repeat(batch // 2 + 1)[:batch]
    if name == "flow_estimator":
        mel = lambda: torch.randn(batch, config.mel_bins, frames, generator=generator)  # noqa: E731
        mask = torch.ones(batch, 1, frames)
        mask[1:, :, frames - 6:] = 0
        return (mel(), mask, mel(), torch.rand(batch, generator=generator),
                torch.randn(batch, config.mel_bins, generator=generator), mel(), streaming)
    if name == "flow_encoder":
        lookahead = config.pre_lookahead_len
        tokens = frames // config.token_mel_ratio
        x = torch.randn(batch, tokens + lookahead, config.encoder.input_size, generator=generator)
        lengths = torch.full((batch,), tokens, dtype=torch.long)
        lengths[1:] = tokens - 4
        context = torch.full((batch,), lookahead, dtype=torch.long)
        context[1:] = 0
        return x, lengths, context, streaming
    if name == "hift_decode":
        mel = torch.randn(batch, config.mel_bins, frames, generator=generator) - 5
        source = torch.randn(batch, 1, frames * hift.samples_per_frame, generator=generator) * 0.1
        return mel, source
    raise ValueError(f"no graph {name!r}")
