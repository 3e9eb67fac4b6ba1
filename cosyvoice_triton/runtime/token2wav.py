"""Speech tokens -> waveform for one synthesis stream: the flow model, then the HiFT vocoder.

A `Token2WavStream` holds everything one stream needs between chunks: the prompt (tokens, mel,
speaker embedding), the tokens generated so far, the chunk schedule and the vocoder caches. Nothing is
shared between streams, so many can run side by side; `close()` frees the state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.flow import FlowModel
from ..models.hift import HiFTGenerator
from .chunk_policy import ChunkPolicy, ChunkSchedule
from .vocoder_stream import VocoderStream


@dataclass
class FlowPrompt:
    """The flow-side prompt of a voice."""

    speech_tokens: torch.Tensor  # (1, P) int32
    mel: torch.Tensor  # (1, 2P, 80) float32
    embedding: torch.Tensor  # (1, 192) float32


class Token2Wav:
    """The flow + HiFT pair shared by all streams of one model instance."""

    def __init__(self, flow: FlowModel, hift: HiFTGenerator):
        self.flow = flow
        self.hift = hift
        self.token_mel_ratio = flow.config.token_mel_ratio
        self.samples_per_frame = hift.config.samples_per_frame

    @torch.inference_mode()
    def mel(self, tokens: torch.Tensor, prompt: FlowPrompt, token_offset: int, finalize: bool,
            streaming: bool) -> torch.Tensor:
        """Mel frames of tokens[offset:] given the whole token history. (1, T) -> (1, 80, frames)."""
        device = prompt.mel.device
        tokens = tokens.to(device)
        mel = self.flow.inference(
            token=tokens,
            token_len=torch.tensor([tokens.shape[1]], dtype=torch.int32, device=device),
            prompt_token=prompt.speech_tokens,
            prompt_token_len=torch.tensor([prompt.speech_tokens.shape[1]], dtype=torch.int32, device=device),
            prompt_feat=prompt.mel,
            prompt_feat_len=torch.tensor([prompt.mel.shape[1]], dtype=torch.int32, device=device),
            embedding=prompt.embedding,
            streaming=streaming,
            finalize=finalize,
        )
        return mel[:, :, token_offset * self.token_mel_ratio:]

    def stream(self, prompt: FlowPrompt, policy: ChunkPolicy, noise) -> "Token2WavStream":
        return Token2WavStream(self, prompt, policy, noise)


class Token2WavStream:
    """Turns a growing list of speech tokens into audio chunks, following a chunk schedule."""

    def __init__(self, engine: Token2Wav, prompt: FlowPrompt, policy: ChunkPolicy, noise):
        self.engine = engine
        self.prompt = prompt
        self.schedule: ChunkSchedule = policy.schedule(prompt.speech_tokens.shape[1])
        self.vocoder = VocoderStream(engine.hift, noise=noise)
        self.tokens: list[int] = []

    def push(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def ready(self) -> bool:
        """True when enough tokens arrived for the next non-final chunk."""
        return len(self.tokens) >= self.schedule.needed

    def next_chunk(self) -> np.ndarray:
        """Audio of the next non-final chunk; call only when `ready()`."""
        offset, end = self.schedule.advance()
        tokens = torch.tensor([self.tokens[:end]], dtype=torch.int32)
        mel = self.engine.mel(tokens, self.prompt, offset, finalize=False, streaming=True)
        return _to_numpy(self.vocoder.push(mel, finalize=False))

    def finish(self) -> np.ndarray:
        """Audio of every token not yet emitted; the stream is done afterwards."""
        tokens = torch.tensor([self.tokens], dtype=torch.int32)
        mel = self.engine.mel(tokens, self.prompt, self.schedule.offset, finalize=True, streaming=False)
        audio = _to_numpy(self.vocoder.push(mel, finalize=True))
        self.close()
        return audio

    def close(self) -> None:
        self.vocoder.close()
        self.tokens = []


def _to_numpy(audio: torch.Tensor) -> np.ndarray:
    """(1, N) vocoder output -> (N,) float32 on the host."""
    return audio.squeeze(0).float().cpu().numpy()
