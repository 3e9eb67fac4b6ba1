"""CosyVoice3's causal HiFT vocoding of one stream, chunk by chunk.

The official `token2wav` keeps every mel frame so far, runs the vocoder on all of them at each chunk
(non-final: the last 8 frames make no samples yet; final: all of them) and emits the samples after those
already sent: O(frames so far) per chunk. The vocoder is causal with a finite reach to the left, so this
stream runs it on a window instead (`CausalHiFTGenerator.inference_window`): from `context_frames` (37 on the
released config) before the first sample to emit, to the end. Carried between chunks:
- the mel of the window's frames (the context and the frames held back), nothing older;
- the source's phase accumulated over every frame before the window (float64, (B, 9)), which the official
  sums over the whole mel at every call;
- the count of samples sent, which is also where the window reads the fixed noise.
The chunks join without a cross-fade (unlike CosyVoice2's `VocoderStream`); together they equal the
official re-runs within float rounding (~1e-7). `close()` frees the state.

The noise is the vocoder's own fixed noise (the official draws it once, at construction): a request's seed
does not reach it (`seeded_noise`), so a chunk's audio depends on its mel only. `speed` != 1.0 interpolates
each chunk's new mel by 1 / speed before the window (token2wav/speed.py): one final chunk is the official
offline `F.interpolate`; streamed, as CosyVoice2's streams (the official CosyVoice3 changes speed offline only).

`push` runs the three steps; `prepare` / `vocode` / `commit` split them for a caller that must make the audio
of several streams before any of them changes (token2wav/scheduler.py), as `VocoderStream`'s do.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import InvalidInput
from ..models.causal_hift import CausalHiFTGenerator
from ..models.hift_source import HiFTNoise
from .speed import MelSpeed, SpeedState


class WindowInput(NamedTuple):
    """`prepare`'s result: the window's mel (B, n_mels, T) (kept frames, then the chunk's, stretched) and the
    speed state after the chunk."""

    mel: Tensor
    speed_state: SpeedState


class CausalVocoderStream:
    """The vocoder state of one stream. Not shared, not thread-safe; `close()` frees it."""

    def __init__(self, hift: CausalHiFTGenerator, noise: HiFTNoise | None = None, speed: float = 1.0):
        self.hift = hift
        self.noise = noise  # None: the vocoder's own fixed noise
        self.speed = MelSpeed(speed)
        self.speed_state = SpeedState()
        self.mel: Tensor | None = None  # (B, n_mels, frames): frames first .. so far, the next window
        self.first = 0  # absolute index of self.mel's first frame
        self.cycles: Tensor | None = None  # (B, H) float64: the phase over the frames before the window's source
        self.frames = 0  # mel frames so far (after the speed change)
        self.emitted = 0  # samples sent
        self.closed = False

    @staticmethod
    def seeded_noise(seed: int | None) -> None:
        """The noise of a stream with this vocoder seed: None, the vocoder's fixed noise (the seed is not used)."""
        return None

    def check_chunk(self, new_frames: int, finalize: bool) -> None:
        """InvalidInput naming `chunk_first_hop` if a non-final chunk would leave the mel so far too short to make
        any sample (the vocoder holds back `held_back_frames` frames)."""
        frames = self.frames + self.speed.output_frames(self.speed_state, new_frames, finalize)
        held = self.hift.config.held_back_frames
        if not finalize and frames <= held:
            raise InvalidInput("chunk_first_hop", f"a non-final chunk needs more than {held} mel frames so far, "
                                                  f"got {frames}")

    @torch.inference_mode()
    def prepare(self, new_mel: Tensor, finalize: bool) -> WindowInput:
        """New mel frames (B, n_mels, T) -> the window to vocode: the kept frames, then the new ones stretched
        by the speed. Changes nothing."""
        if self.closed:
            raise RuntimeError("vocoder stream is closed")
        self.check_chunk(new_mel.shape[2], finalize)
        new_mel, speed_state = self.speed.stretch(self.speed_state, new_mel, finalize)
        mel = new_mel if self.mel is None else torch.cat([self.mel, new_mel], dim=2)  # along time
        return WindowInput(mel, speed_state)

    @torch.inference_mode()
    def vocode(self, window: WindowInput, finalize: bool) -> tuple[Tensor, Tensor]:
        """The vocoder on the window -> (audio from the window's source start, the phase after each frame)."""
        cycles = self.cycles
        if cycles is None:  # the window starts at the first frame
            cycles = torch.zeros(window.mel.shape[0], self.hift.m_source.l_linear.in_features, dtype=torch.float64,
                                 device=window.mel.device)
        return self.hift.inference_window(window.mel, self.first, cycles, finalize, self.noise)

    @torch.inference_mode()
    def commit(self, window: WindowInput, vocoded: tuple[Tensor, Tensor], finalize: bool) -> Tensor:
        """`vocode`'s output -> the audio to emit (B, N): non-final N = (frames so far - 8) * 480 minus the samples
        already sent; final: the rest. Moves the window on, or frees the stream after the final chunk."""
        if self.closed:
            raise RuntimeError("vocoder stream is closed")
        speech, cycles = vocoded
        spf = self.hift.config.samples_per_frame
        source_start = self.first + (self.hift.f0_context if self.first > 0 else 0)  # speech's first frame
        audio = speech[:, self.emitted - spf * source_start:]
        self.frames = self.first + window.mel.shape[2]
        self.speed_state = window.speed_state
        if finalize:
            self.close()
        else:
            self.emitted += audio.shape[1]
            self._keep(window.mel, cycles, source_start)
        return audio

    def push(self, new_mel: Tensor, finalize: bool) -> Tensor:
        """New mel frames of a chunk (B, n_mels, T) -> audio to emit (B, N): `prepare`, `vocode`, `commit`."""
        window = self.prepare(new_mel, finalize)
        return self.commit(window, self.vocode(window, finalize), finalize)

    def _keep(self, mel: Tensor, cycles: Tensor, source_start: int) -> None:
        """Move the window to start `context_frames` before the next sample to emit."""
        self.mel = mel
        if self.cycles is None:
            self.cycles = cycles[:, 0]  # zeros: the phase before the first frame
        first = self.emitted // self.hift.config.samples_per_frame - self.hift.context_frames
        if first <= self.first:
            return  # still within this window (the stream's start, or a chunk smaller than the context)
        self.mel = mel[:, :, first - self.first:]
        # The phase over the frames before the next window's source (its first frame + the F0 context).
        self.cycles = cycles[:, first + self.hift.f0_context - source_start]
        self.first = first

    def close(self) -> None:
        """Drop the state; the stream cannot be used afterwards. Safe to call more than once."""
        self.mel, self.cycles, self.frames, self.emitted, self.closed = None, None, 0, 0, True
        self.speed_state = SpeedState()
