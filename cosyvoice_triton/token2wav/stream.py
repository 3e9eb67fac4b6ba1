"""Speech tokens -> waveform for one synthesis stream: the flow model, then the vocoder.

A `Token2WavStream` holds everything one stream needs between chunks: the prompt (tokens, mel,
speaker embedding), the tokens generated so far, the chunk schedule and the vocoder caches. Nothing is
shared between streams, so many can run side by side; `close()` frees the state.

Either family: the flow's per-stream cache and the vocoder stream come from the family seams
(models/family.py `models_of_flow`, token2wav/vocoders.py), so CosyVoice2's UNet cache and HiFT cross-fade
and CosyVoice3's DiT cache and windowed causal HiFT run through the same code.
"""
from __future__ import annotations

import numpy as np
import torch

from ..messages import FlowPrompt
from ..models.family import Vocoder, models_of_flow
from ..models.flow import TokenToMel
from ..models.flow_cache import FlowCacheSettings, MapRows, StreamFlowCache
from ..models.hift_source import HiFTNoise
from ..models.prompt_cache import PromptCache, frames_to_store, new_stream_cache, stage_prompt_cache
from .vocoders import vocoder_stream_class


def prompt_tensors(prompt: FlowPrompt) -> FlowPrompt:
    """The prompt as host torch tensors of the dtypes given. numpy arrays are copied (stored voices are
    read-only shared arrays, and torch wants writable memory); tensors are taken as they are."""
    def tensor(values) -> torch.Tensor:
        return values if isinstance(values, torch.Tensor) else torch.from_numpy(np.array(values))

    return FlowPrompt(speech_tokens=tensor(prompt.speech_tokens), mel=tensor(prompt.mel),
                      embedding=tensor(prompt.embedding))


class Token2Wav:
    """The flow + vocoder pair shared by all streams of one model instance."""

    def __init__(self, flow: TokenToMel, hift: Vocoder, flow_cache: FlowCacheSettings = FlowCacheSettings(),
                 prompt_cache: PromptCache | None = None, map_rows: MapRows | None = None):
        self.flow = flow
        models = models_of_flow(flow)
        self._cached_solver = models.cached_mel
        # Graph engines (ONNX, TensorRT, OpenVINO) re-run the flow over every frame.
        self.flow_cache = models.cache_settings(flow, flow_cache)
        # The voices' share of the flow (models/prompt_cache.py); pass one to share it with another stage.
        self.prompt_cache = stage_prompt_cache(self.flow_cache, prompt_cache)
        self.hift = hift
        self.vocoder_stream = vocoder_stream_class(hift)
        self.token_mel_ratio = flow.config.token_mel_ratio
        self.samples_per_frame = hift.config.samples_per_frame
        self.device = next(flow.parameters()).device
        # With the flow cache: the estimator's rows one by one, spread over the cores (pipeline/threads.py
        # RowWorkers), the final full-attention pass too; None: one pass over the batch per Euler step.
        self.map_rows = map_rows if self.flow_cache is not None else None

    @torch.inference_mode()
    def mel(self, tokens: torch.Tensor, prompt: FlowPrompt, token_offset: int, finalize: bool,
            streaming: bool, cache: StreamFlowCache | None = None, next_offset: int = 0) -> torch.Tensor:
        """Mel frames of tokens[offset:] given the whole token history. (1, T) -> (1, 80, frames).

        With a cache (streaming calls), only the frames after the cached ones are computed, and the cache
        grows by the frames made final, up to the frames of `next_offset` (where the next call starts).
        An empty cache with a `voice_key` (`PromptCache.open_stream`) also stores the voice's frames."""
        if (cache is not None and streaming) or self.map_rows is not None:
            return self._cached_mel(tokens, prompt, token_offset, finalize, cache if streaming else None,
                                    next_offset, streaming)
        return self._flow_inputs(tokens, prompt, self.flow.inference, streaming, finalize)[
            :, :, token_offset * self.token_mel_ratio:]

    def _cached_mel(self, tokens: torch.Tensor, prompt: FlowPrompt, token_offset: int, finalize: bool,
                    cache: StreamFlowCache | None, next_offset: int, streaming: bool = True) -> torch.Tensor:
        """`mel` through `cached_mel`: a streaming call with the stream's cache, or (cache None) a call
        that computes every frame."""
        conditions = self._flow_inputs(tokens, prompt, self.flow.conditions, streaming, finalize)
        prompt_frames = prompt.mel.shape[1]
        voice = frames_to_store(self.flow, self.flow_cache, self.prompt_cache, prompt, cache)
        mel, (start,), (kept,), (voice_cache,) = self._cached_solver(
            self.flow, conditions, [cache], [prompt_frames + self.token_mel_ratio * next_offset],
            self.flow_cache.max_frames, [voice], self.map_rows)
        if voice_cache is not None:
            self.prompt_cache.store(cache.voice_key, voice_cache)
        if cache is not None:
            cache.replace_with(kept)
        first = prompt_frames + self.token_mel_ratio * token_offset - start  # >= 0: cached frames were spoken
        return mel[:, :, first:int(conditions.mel_len[0]) - start]

    def _flow_inputs(self, tokens: torch.Tensor, prompt: FlowPrompt, call, streaming: bool, finalize: bool):
        """call(...) with one row's flow inputs: `FlowModel.inference` or `FlowModel.conditions`."""
        device = self.device
        tokens = tokens.to(device)
        return call(
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

    def new_flow_cache(self, prompt: FlowPrompt) -> StreamFlowCache | None:
        """A new stream's flow cache (None: off), seeded with the voice's frames when the prompt cache has them."""
        return new_stream_cache(self.flow, self.flow_cache, self.prompt_cache, prompt)

    def noise(self, seed: int | None) -> HiFTNoise | None:
        """A stream's vocoder noise for its seed: CosyVoice2's drawn from the seed, CosyVoice3's fixed (None)."""
        return self.vocoder_stream.seeded_noise(seed)

    def stream(self, prompt: FlowPrompt, noise: HiFTNoise | None, lookahead: int | None = None,
               speed: float = 1.0) -> "Token2WavStream":
        """A new stream; `noise`: the vocoder's (`noise(seed)`; None: the vocoder's own fixed noise, CosyVoice3)."""
        lookahead = self.flow.config.pre_lookahead_len if lookahead is None else lookahead
        return Token2WavStream(self, prompt_tensors(prompt), noise, lookahead, speed)


class Token2WavStream:
    """Turns a growing list of speech tokens into audio chunks for one stream.

    `chunk(new_tokens, finalize)` is the primitive: a non-final chunk runs the flow on every token so
    far (streaming attention), emits the frames after the current offset and moves the offset to the
    last `lookahead` tokens, which only served as right context; the final chunk emits the rest (one
    full-attention pass, or with `FlowCacheSettings.cached_final` a streaming one). With the flow cache
    on, the frames already final are not recomputed (models/flow_cache.py), and a stream of a prompt seen
    before starts from its voice-final frames (models/prompt_cache.py).
    """

    def __init__(self, token2wav: Token2Wav, prompt: FlowPrompt, noise, lookahead: int, speed: float = 1.0):
        self.token2wav = token2wav
        self.prompt = prompt
        self.lookahead = lookahead
        self.vocoder = token2wav.vocoder_stream(token2wav.hift, noise=noise, speed=speed)
        self.tokens: list[int] = []
        self.offset = 0  # tokens already turned into audio
        self.flow_cache = token2wav.new_flow_cache(self.prompt)

    def chunk(self, new_tokens: list[int], finalize: bool) -> np.ndarray:
        self.tokens.extend(new_tokens)
        if not self.tokens:  # no speech tokens at all (an LLM that stopped at once): no audio, as the scheduler
            if finalize:
                self.close()
            return np.zeros(0, dtype=np.float32)
        tokens = torch.tensor([self.tokens], dtype=torch.int32)
        if self.flow_cache is None:
            mel = self.token2wav.mel(tokens, self.prompt, self.offset, finalize=finalize, streaming=not finalize)
        else:
            streaming = not finalize or self.token2wav.flow_cache.cached_final
            mel = self.token2wav.mel(tokens, self.prompt, self.offset, finalize=finalize, streaming=streaming,
                                     cache=self.flow_cache, next_offset=len(self.tokens) - self.lookahead)
        self.vocoder.check_chunk(mel.shape[2], finalize)
        audio = _to_numpy(self.vocoder.push(mel, finalize=finalize))
        if finalize:
            self.close()
        else:
            self.offset = len(self.tokens) - self.lookahead
        return audio

    def close(self) -> None:
        self.vocoder.close()
        self.tokens = []
        self.flow_cache = None


def _to_numpy(audio: torch.Tensor) -> np.ndarray:
    """(1, N) vocoder output -> (N,) float32 on the host."""
    return audio.squeeze(0).float().cpu().numpy()
