"""HiFT vocoding of one synthesis stream, chunk by chunk, without seams.

Each chunk of new mel frames is vocoded together with the last `mel_cache_frames` frames of the
previous chunk, and the source signal of those repeated frames is taken over from the previous call,
so the excitation runs on continuously. A non-final chunk holds back its last `source_cache_samples`
samples; the next chunk fades them out while it fades its own first samples in (a symmetric Hamming
window of twice that length, rising half and falling half). The final chunk emits everything.

`speed` != 1.0 interpolates each chunk's new mel frames along time by 1 / speed first (token2wav/speed.py,
as the official CosyVoice2), so the caches and the cross-fade work on the stretched frames alike.

`push` runs the three steps; `prepare` / `vocode` / `commit` split them for a caller that must make the audio
of several streams before any of them changes (token2wav/scheduler.py), as `CausalVocoderStream`'s do.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..errors import InvalidInput
from ..models.hift import HiFTGenerator
from ..models.hift_source import GeneratorNoise, HiFTNoise
from .speed import MelSpeed, SpeedState


class HiFTInput(NamedTuple):
    """`prepare`'s result: the vocoder's mel (B, n_mels, T') and the cached source (B, 1, S), None at first."""

    mel: Tensor
    cache_source: Tensor | None


@dataclass(frozen=True)
class VocoderStreamConfig:
    mel_cache_frames: int = 8  # mel frames repeated from the previous chunk
    samples_per_frame: int = 480  # 24 kHz / 50 Hz

    @property
    def source_cache_samples(self) -> int:
        """Source samples carried over, and audio samples held back for the cross-fade (3840)."""
        return self.mel_cache_frames * self.samples_per_frame


@lru_cache(maxsize=8)
def _crossfade_window(samples: int, device: torch.device) -> Tensor:
    """Symmetric Hamming window of 2 * samples points, fp64 as in the reference (numpy's np.hamming)."""
    return torch.from_numpy(np.hamming(2 * samples)).to(device)


class VocoderStream:
    """The HiFT state of one stream. Not shared, not thread-safe; `close()` frees it."""

    def __init__(self, hift: HiFTGenerator, noise: HiFTNoise, config: VocoderStreamConfig | None = None,
                 speed: float = 1.0):
        self.hift = hift
        self.noise = noise
        self.config = config or VocoderStreamConfig(samples_per_frame=hift.config.samples_per_frame)
        if self.config.samples_per_frame != hift.config.samples_per_frame:
            raise ValueError(f"samples_per_frame {self.config.samples_per_frame} != vocoder's "
                             f"{hift.config.samples_per_frame}")
        self.cached_mel: Tensor | None = None  # (B, n_mels, mel_cache_frames)
        self.cached_source: Tensor | None = None  # (B, 1, source_cache_samples)
        self.cached_audio: Tensor | None = None  # (B, source_cache_samples), held back for the fade
        self.speed = MelSpeed(speed)
        self.speed_state = SpeedState()
        self._next_speed_state = self.speed_state  # prepare's, kept by commit
        self.closed = False

    @staticmethod
    def seeded_noise(seed: int | None) -> GeneratorNoise:
        """The noise of a stream with this vocoder seed: a generator of its own (None: a random seed)."""
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return GeneratorNoise(generator)

    def check_chunk(self, new_frames: int, finalize: bool) -> None:
        """InvalidInput naming `speed` if a chunk of `new_frames` mel frames would leave this stream's first
        non-final vocoder call too short for its cross-fade once stretched (a chunk that would fail `commit`)."""
        if finalize or self.cached_mel is not None:
            return
        frames = self.speed.output_frames(self.speed_state, new_frames, finalize)
        if frames < self.config.mel_cache_frames:
            raise InvalidInput("speed", f"at speed {self.speed.speed:g} the first chunk's {new_frames} mel frames "
                               f"become {frames}, fewer than the {self.config.mel_cache_frames} the vocoder holds "
                               "back: a larger first chunk (chunk_first_hop) or a lower speed")

    @torch.inference_mode()
    def prepare(self, new_mel: Tensor, finalize: bool = False) -> HiFTInput:
        """New mel frames (B, n_mels, T) -> the vocoder's input: mel (B, n_mels, T') stretched by the speed,
        with the cached frames in front, and the cached source (B, 1, S) or None on the first chunk."""
        if self.closed:
            raise RuntimeError("vocoder stream is closed")
        new_mel, self._next_speed_state = self.speed.stretch(self.speed_state, new_mel, finalize)
        if self.cached_mel is None:
            return HiFTInput(new_mel, None)
        return HiFTInput(torch.cat([self.cached_mel, new_mel], dim=2), self.cached_source)  # along time

    @torch.inference_mode()
    def vocode(self, prepared: HiFTInput, finalize: bool) -> tuple[Tensor, Tensor]:
        """HiFT on `prepare`'s input -> (audio (B, L), source (B, 1, L)). Moves only the noise generator on."""
        return self.hift.inference(prepared.mel, prepared.cache_source, self.noise)

    @torch.inference_mode()
    def commit(self, prepared: HiFTInput, vocoded: tuple[Tensor, Tensor], finalize: bool) -> Tensor:
        """`vocode`'s output -> the audio to emit (B, N); updates or releases the state."""
        if self.closed:
            raise RuntimeError("vocoder stream is closed")
        mel, (audio, source) = prepared.mel, vocoded
        self.speed_state = self._next_speed_state
        held = self.config.source_cache_samples
        if self.cached_audio is not None:
            audio = self._crossfade(audio, self.cached_audio)
        if finalize:
            self.close()
            return audio
        if audio.shape[1] < held:
            raise ValueError(f"a non-final chunk needs at least {self.config.mel_cache_frames} mel frames, "
                             f"got {mel.shape[2]}")
        self.cached_mel = mel[:, :, -self.config.mel_cache_frames:]
        self.cached_source = source[:, :, -held:]
        self.cached_audio = audio[:, -held:]
        return audio[:, :-held]

    @torch.inference_mode()
    def push(self, new_mel: Tensor, finalize: bool) -> Tensor:
        """New mel frames of a chunk (B, n_mels, T) -> audio to emit (B, N), on the vocoder's device.

        Non-final: N = (T' + cached frames) * samples_per_frame - source_cache_samples; final: all of it
        (T' = T at speed 1.0, about T / speed otherwise).
        """
        prepared = self.prepare(new_mel, finalize)
        return self.commit(prepared, self.vocode(prepared, finalize), finalize)

    def close(self) -> None:
        """Drop the caches; the stream cannot be used afterwards. Safe to call more than once."""
        self.cached_mel = self.cached_source = self.cached_audio = None
        self.speed_state = self._next_speed_state = SpeedState()
        self.closed = True

    def _crossfade(self, audio: Tensor, previous_tail: Tensor) -> Tensor:
        """Fade `previous_tail` (B, S) out over the first S samples of `audio` (B, N) while fading them in."""
        S = previous_tail.shape[1]
        window = _crossfade_window(S, audio.device)
        head = audio[:, :S] * window[:S] + previous_tail * window[S:]  # fp64, cast back as the reference does
        return torch.cat([head.to(audio.dtype), audio[:, S:]], dim=1)
