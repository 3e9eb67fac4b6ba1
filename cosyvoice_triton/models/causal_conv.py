"""The causal convolutions of CosyVoice3's vocoder (official `CausalConv1d`, `CausalConv1dUpsample`,
`CausalConv1dDownSample`). Output frame t sees input frames <= t, or, for the look-ahead kind, a fixed
number of frames after t that a streaming caller passes as right context."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_triton.models.hift_source import WeightNormedConv1d


class LeftPaddedConv1d(WeightNormedConv1d):
    """Conv1d with dilation * (kernel - 1) zeros on the left. (B, C, T) -> (B, C', T)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1):
        super().__init__(in_channels, out_channels, kernel_size, dilation=dilation)
        self.left = dilation * (kernel_size - 1)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.left, 0)))


class LookaheadConv1d(WeightNormedConv1d):
    """Conv1d that reads `kernel - 1` frames ahead. finalize: zeros after the last frame, (B, C, T) -> (B, C', T);
    else the last `lookahead` frames are right context only: (B, C, T) -> (B, C', T - lookahead)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.lookahead = kernel_size - 1

    def forward(self, x: Tensor, finalize: bool = True) -> Tensor:
        return super().forward(F.pad(x, (0, self.lookahead)) if finalize else x)


class CausalUpsample(WeightNormedConv1d):
    """Nearest-neighbour upsampling by `rate`, then a left-padded Conv1d. (B, C, T) -> (B, C', rate * T)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, rate: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.rate = rate

    def forward(self, x: Tensor) -> Tensor:
        x = F.interpolate(x, scale_factor=float(self.rate), mode="nearest")
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalDownsample(nn.Conv1d):
    """Strided Conv1d (kernel 2 * stride) with stride - 1 zeros on the left. (B, C, T) -> (B, C', ceil(T / stride))."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__(in_channels, out_channels, 2 * stride, stride)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))
