"""Speech tokens -> waveform for one synthesis stream: the flow model, then the HiFT vocoder.

A `Token2WavStream` holds everything one stream needs between chunks: the prompt (tokens, mel,
speaker embedding), the tokens generated so far, the chunk schedule and the vocoder caches. Nothing is
shared between streams, so many can run side by side; `close()` frees the state.
"""
from __future__ import annotations

import numpy as np
import torch

from ..messages import FlowPrompt
from ..models.flow import FlowModel
from ..models.hift import HiFTGenerator
from .vocoder_stream import VocoderStream


def prompt_tensors(prompt: FlowPrompt) -> FlowPrompt:
    """The prompt as host torch tensors of the dtypes given. numpy arrays are copied (stored voices are
    read-only shared arrays, and torch wants writable memory); tensors are taken as they are."""
    def tensor(values) -> torch.Tensor:
        return values if isinstance(values, torch.Tensor) else torch.from_numpy(np.array(values))

    return FlowPrompt(speech_tokens=tensor(prompt.speech_tokens), mel=tensor(prompt.mel),
                      embedding=tensor(prompt.embedding))


class Token2Wav:
    """The flow + HiFT pair shared by all streams of one model instance."""

    def __init__(self, flow: FlowModel, hift: HiFTGenerator):
        self.flow = flow
        self.hift = hift
        self.token_mel_ratio = flow.config.token_mel_ratio
        self.samples_per_frame = hift.config.samples_per_frame
        self.device = next(flow.parameters()).device

    @torch.inference_mode()
    def mel(self, tokens: torch.Tensor, prompt: FlowPrompt, token_offset: int, finalize: bool,
            streaming: bool) -> torch.Tensor:
        """Mel frames of tokens[offset:] given the whole token history. (1, T) -> (1, 80, frames)."""
        device = self.device
        tokens = tokens.to(device)
        mel = self.flow.inference(
            token=tokens,
            token_len=torch.tensor([tokens.shape[1]], dtype=torch.int32, device=device),
            prompt_token=prompt.speech_tokens.to(device),
            prompt_token_len=torch.tensor([prompt.speech_tokens.shape[1]], dtype=torch.int32, device=device),
            prompt_feat=prompt.mel.to(device),
            prompt_feat_len=torch.tensor([prompt.mel.shape[1]], dtype=torch.int32, device=device),
            embedding=prompt.embedding.to(device),
            streaming=streaming,
            finalize=finalize,
        )
        return mel[:, :, token_offset * self.token_mel_ratio:]

    def stream(self, prompt: FlowPrompt, noise, lookahead: int | None = None) -> "Token2WavStream":
        lookahead = self.flow.config.pre_lookahead_len if lookahead is None else lookahead
        return Token2WavStream(self, prompt_tensors(prompt), noise, lookahead)


class Token2WavStream:
    """Turns a growing list of speech tokens into audio chunks for one stream.

    `chunk(new_tokens, finalize)` is the primitive: a non-final chunk runs the flow on every token so
    far (streaming attention), emits the frames after the current offset and moves the offset to the
    last `lookahead` tokens, which only served as right context; the final chunk emits the rest.
    """

    def __init__(self, engine: Token2Wav, prompt: FlowPrompt, noise, lookahead: int):
        self.engine = engine
        self.prompt = prompt
        self.lookahead = lookahead
        self.vocoder = VocoderStream(engine.hift, noise=noise)
        self.tokens: list[int] = []
        self.offset = 0  # tokens already turned into audio

    def chunk(self, new_tokens: list[int], finalize: bool) -> np.ndarray:
        self.tokens.extend(new_tokens)
        tokens = torch.tensor([self.tokens], dtype=torch.int32)
        mel = self.engine.mel(tokens, self.prompt, self.offset, finalize=finalize, streaming=not finalize)
        audio = _to_numpy(self.vocoder.push(mel, finalize=finalize))
        if finalize:
            self.close()
        else:
            self.offset = len(self.tokens) - self.lookahead
        return audio

    def close(self) -> None:
        self.vocoder.close()
        self.tokens = []


def _to_numpy(audio: torch.Tensor) -> np.ndarray:
    """(1, N) vocoder output -> (N,) float32 on the host."""
    return audio.squeeze(0).float().cpu().numpy()
