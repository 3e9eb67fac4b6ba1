"""CosyVoice3's causal HiFT vocoding of one stream, chunk by chunk, as the official `token2wav` does it.

The stream keeps every mel frame so far and runs the vocoder on all of them at each chunk (non-final:
the last 8 frames make no samples yet; final: all of them), then emits the samples after those already
sent (`emitted`). The vocoder is causal, so the samples already sent come out the same again: the chunks
join without a cross-fade (unlike CosyVoice2's `VocoderStream`), and together they equal one offline call.
Re-running the whole mel costs O(frames) per chunk, as the official code does; nothing is kept but the mel
and a count, and `close()` frees them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InvalidInput
from ..models.causal_hift import CausalHiFTGenerator
from ..models.hift_source import HiFTNoise


class CausalVocoderStream:
    """The vocoder state of one stream. Not shared, not thread-safe; `close()` frees it."""

    def __init__(self, hift: CausalHiFTGenerator, noise: HiFTNoise | None = None):
        self.hift = hift
        self.noise = noise  # None: the vocoder's own fixed noise
        self.mel: Tensor | None = None  # (B, n_mels, frames so far)
        self.emitted = 0  # samples sent
        self.closed = False

    def check_chunk(self, new_frames: int, finalize: bool) -> None:
        """InvalidInput naming `chunk_first_hop` if a non-final chunk would leave the mel so far too short to make
        any sample (the vocoder holds back `held_back_frames` frames)."""
        frames = new_frames + (0 if self.mel is None else self.mel.shape[2])
        held = self.hift.config.held_back_frames
        if not finalize and frames <= held:
            raise InvalidInput("chunk_first_hop", f"a non-final chunk needs more than {held} mel frames so far, "
                                                  f"got {frames}")

    @torch.inference_mode()
    def push(self, new_mel: Tensor, finalize: bool) -> Tensor:
        """New mel frames (B, n_mels, T) -> audio to emit (B, N): non-final N = (frames so far - 8) * 480 minus
        the samples already sent; final: the rest."""
        if self.closed:
            raise RuntimeError("vocoder stream is closed")
        self.check_chunk(new_mel.shape[2], finalize)
        mel = new_mel if self.mel is None else torch.cat([self.mel, new_mel], dim=2)  # along time
        speech, _ = self.hift.inference(mel, finalize=finalize, noise=self.noise)
        audio = speech[:, self.emitted:]
        if finalize:
            self.close()
        else:
            self.mel, self.emitted = mel, self.emitted + audio.shape[1]
        return audio

    def close(self) -> None:
        """Drop the state; the stream cannot be used afterwards. Safe to call more than once."""
        self.mel, self.emitted, self.closed = None, 0, True
