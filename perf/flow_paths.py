"""A flow's two paths on one voice, as the quality tools run them (perf/flow_quality.py, perf/flow_int8_static.py).

`load_judged` loads a folder's flow and vocoder in fp32 and one voice (a speech-like recording through the
prompt encoder); `offline` is one full-attention pass over every token (the official non-streamed path);
`streamed` the chunks of a chunk preset's schedule through a `Token2WavStream`, as a served stream makes them.
Each returns the flow's mel and the vocoder's waveform, the vocoder's noise seeded.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cosyvoice_triton.messages import FlowPrompt
from cosyvoice_triton.models.hift_source import GeneratorNoise
from cosyvoice_triton.perf.bench_official import PROMPT_RATE, PROMPT_TEXT, prompt_recording
from cosyvoice_triton.pipeline.chunk_policy import CHUNK_PRESETS, ChunkSchedule


def load_judged(model_dir: str, prompt_tokens: int) -> tuple:
    """(flow, hift, prompt tensors) of a model folder: its flow and vocoder in fp32, and one voice, a speech-like
    recording of `prompt_tokens` / 25 s through the prompt encoder."""
    from cosyvoice_triton.models.family import family_models
    from cosyvoice_triton.pipeline.pipeline import flow_prompt_of
    from cosyvoice_triton.preprocess.prompt import PromptEncoder
    from cosyvoice_triton.token2wav.stream import prompt_tensors

    models = family_models(model_dir)
    flow, hift = models.load_flow(model_dir), models.load_vocoder(model_dir)
    voice = PromptEncoder.from_model_dir(model_dir).encode(prompt_recording(prompt_tokens), PROMPT_RATE, PROMPT_TEXT)
    return flow, hift, prompt_tensors(flow_prompt_of(voice))


def offline(token2wav, prompt: FlowPrompt, tokens: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(mel (80, T), waveform (S,)) of one full-attention pass over every token."""
    mel = token2wav.mel(torch.tensor([tokens], dtype=torch.int32), prompt, 0, finalize=True, streaming=False)
    stream = token2wav.stream(prompt, GeneratorNoise(torch.Generator().manual_seed(seed)))
    audio = stream.vocoder.push(mel, finalize=True)
    stream.close()
    return mel[0].float().numpy(), audio.squeeze(0).float().numpy()


def streamed(token2wav, prompt: FlowPrompt, tokens: list[int], seed: int, preset: str = "official",
             cached_final: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(mel (80, T) the chunks emitted, waveform) of a chunk preset's schedule, chunk by chunk, as a served
    stream makes them; `cached_final` None: the preset's last chunk. `token2wav`: a `TimedToken2Wav`."""
    chosen = CHUNK_PRESETS[preset]
    cached_final = chosen.cached_final if cached_final is None else cached_final
    schedule = ChunkSchedule(chosen.policy(), len(prompt.speech_tokens[0]))
    if token2wav.flow_cache is not None:  # None: a graph estimator, no cache, the final pass full attention
        token2wav.flow_cache = dataclasses.replace(token2wav.flow_cache, cached_final=cached_final)
    token2wav.mels.clear()
    stream = token2wav.stream(prompt, GeneratorNoise(torch.Generator().manual_seed(seed)))
    audio, sent = [], 0
    while schedule.due(len(tokens)):
        _, end = schedule.advance()
        audio.append(stream.chunk(tokens[sent:end], finalize=False))
        sent = end
    audio.append(stream.chunk(tokens[sent:], finalize=True))
    return torch.cat(token2wav.mels, dim=2)[0].float().numpy(), np.concatenate(audio)
