"""Speaking speed: the mel of a stream interpolated linearly along time by 1 / speed, before the vocoder.

This is how the official CosyVoice2 changes speed (`F.interpolate(mel, size=int(T / speed), mode="linear")`
on the whole mel of an offline request). Here it also works chunk by chunk: output frame j of a stream
sits at input position p_j = (j + 0.5) * scale - 0.5 (clamped at 0), as `F.interpolate`'s
align_corners=False, and is the linear mix of the two input frames around it. A non-final chunk emits
every output frame whose two input frames have arrived and keeps its last input frame for the next
chunk; the final chunk emits up to int(total input frames / speed) frames, as the official count.

A stream that is one final chunk (an offline request) is `F.interpolate` itself, bit for bit the
official; a streamed one uses scale = speed (its total length is not known in advance).
`stretch` is pure: it returns the new state, which the caller keeps once the chunk's audio is made.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..messages import check_speed


@dataclass(frozen=True)
class SpeedState:
    frames_in: int = 0  # input mel frames seen so far
    frames_out: int = 0  # output frames emitted so far
    last_frame: Tensor | None = None  # (B, n_mels, 1): the latest input frame, the left neighbour of the next


class MelSpeed:
    """The speed change of one stream. speed 1.0 passes mel through untouched."""

    def __init__(self, speed: float = 1.0):
        self.speed = float(check_speed(speed))

    def output_frames(self, state: SpeedState, new_frames: int, finalize: bool) -> int:
        """How many frames `stretch` emits for a chunk of `new_frames` input frames."""
        if self.speed == 1.0:
            return new_frames
        return self._end(state, state.frames_in + new_frames, finalize) - state.frames_out

    @torch.inference_mode()
    def stretch(self, state: SpeedState, new_mel: Tensor, finalize: bool) -> tuple[Tensor, SpeedState]:
        """New mel frames (B, n_mels, T) -> (interpolated frames (B, n_mels, T'), the state after them)."""
        if self.speed == 1.0:
            return new_mel, state
        T = new_mel.shape[2]
        total = state.frames_in + T
        if state.frames_in == 0 and finalize:  # the whole stream at once: the official call
            out = F.interpolate(new_mel, size=int(T / self.speed), mode="linear") if T else new_mel
            return out, SpeedState(total, out.shape[2], None)
        end = self._end(state, total, finalize)
        if state.last_frame is None:
            window, base = new_mel, state.frames_in  # window[..., k] is input frame base + k
        else:
            window, base = torch.cat([state.last_frame, new_mel], dim=2), state.frames_in - 1  # along time
        out = self._interpolate(window, base, total, state.frames_out, end)
        last = window[:, :, -1:].clone() if window.shape[2] else state.last_frame
        return out, SpeedState(total, end, last)

    def _end(self, state: SpeedState, total: int, finalize: bool) -> int:
        """The output frame count after a chunk that brings the input to `total` frames."""
        if finalize:
            return max(state.frames_out, int(total / self.speed))
        if total == 0:
            return 0
        # every j with p_j <= total - 1: both neighbours of output j have arrived
        return max(state.frames_out, math.floor((total - 0.5) / self.speed + 0.5))

    def _interpolate(self, window: Tensor, base: int, total: int, start: int, end: int) -> Tensor:
        """Output frames [start, end) from `window` (B, n_mels, W), whose frame k is input frame base + k."""
        if end <= start:
            return window[:, :, :0]
        j = torch.arange(start, end, dtype=torch.float64)
        position = ((j + 0.5) * self.speed - 0.5).clamp(min=0.0)
        left = position.floor().clamp(max=total - 1)
        weight = (position - left).clamp(max=1.0).to(window.dtype).to(window.device)  # (T',)
        i0 = left.long() - base
        i1 = (left.long() + 1).clamp(max=total - 1) - base
        assert int(i0.min()) >= 0, "an output frame before the kept input frame"
        i0, i1 = i0.to(window.device), i1.to(window.device)
        return window[:, :, i0] * (1 - weight) + window[:, :, i1] * weight  # (B, n_mels, T')
