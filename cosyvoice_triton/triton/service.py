"""What the `cosyvoice2` and `register_voice` models do, without `pb_utils` of their own.

`Voices` resolves a request's voice: a registered id from the voice store, or a recording through the
`prompt_encoder` ensemble (the audio is checked here first, so errors name the request's field).
`ServedPipeline` turns a parsed request into audio chunks with the shared `Pipeline`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from cosyvoice_triton.config import ModelPaths, read_yaml
from cosyvoice_triton.messages import (ChunkPolicy, PromptFeatures, SamplingParams, SynthesisRequest,
                                       check_voice_serves)
from cosyvoice_triton.pipeline.pipeline import Pipeline
from cosyvoice_triton.pipeline.stages import LLMStage, Token2WavStage
from cosyvoice_triton.pipeline.text_feed import TEXT_IDLE_TIMEOUT_S, TextFeeds
from cosyvoice_triton.preprocess.audio import decode_audio, to_mono, validate_prompt_audio
from cosyvoice_triton.preprocess.text import TextPreprocessor
from cosyvoice_triton.preprocess.voice_features import audio_sha256
from cosyvoice_triton.wire.names import REFERENCE_TEXT
from cosyvoice_triton.wire.requests import PromptAudio, RegisterInputs, SynthesisInputs, TextAppend
from cosyvoice_triton.voices.prompt_budget import PromptBudget, speech_tokens_of
from cosyvoice_triton.voices.store import Recording, VoiceRecord, VoiceStore, register_once

def token_mel_ratio(model_dir: str | Path) -> int:
    return int(read_yaml(ModelPaths(Path(model_dir)).yaml).get("token_mel_ratio", 2))


def prompt_budget(model_dir: str | Path, max_seq_len: int) -> PromptBudget:
    """The transcript check of a model folder's tokenizer for LLM streams of `max_seq_len` positions."""
    return PromptBudget(max_seq_len, TextPreprocessor.from_model_dir(model_dir))


class Voices:
    """Voice store + prompt encoder of one model family (`family`, the server's folder's: its features are the
    ones read and registered). `encoder.encode(samples, rate, text, sha) -> PromptFeatures`.
    With a `budget`, a transcript that would leave an LLM stream no room for a sentence is refused
    (registration and inline prompts alike; `prompt_budget`)."""

    def __init__(self, store: VoiceStore, encoder, budget: PromptBudget | None = None, *, family: str):
        self.store = store
        self.encoder = encoder
        self.budget = budget
        self.family = family

    def check_transcript(self, text: str | None, prompt_speech_tokens: int) -> None:
        """Whether the transcript leaves an LLM stream room (its characters were checked by the parse)."""
        if self.budget is not None and text:
            self.budget.check(text, prompt_speech_tokens, REFERENCE_TEXT)

    @staticmethod
    def samples(audio: PromptAudio) -> tuple[np.ndarray, int]:
        """(samples (N,) float32 mono, rate) of a request's recording, checked; errors name its field."""
        if audio.file_bytes is not None:
            samples, rate = decode_audio(audio.file_bytes, field=audio.field)
        else:
            samples, rate = to_mono(audio.samples), int(audio.sample_rate)
        validate_prompt_audio(samples, rate, audio.field)
        return samples, rate

    def from_audio(self, audio: PromptAudio, text: str) -> PromptFeatures:
        samples, rate = self.samples(audio)
        self.check_transcript(text, speech_tokens_of(samples.shape[0], rate))
        return self.encoder.encode(samples, rate, text, audio_sha256(samples, rate))

    def get(self, voice_id: str, owner: str | None) -> PromptFeatures:
        """The family's features of a registered voice (the owner's of that id, else the shared one), made from its
        recording at its first use with this family (`VoiceStore.get`)."""
        return self.store.get(voice_id, owner, self.family, self.encoder.encode)

    def resolve(self, inputs: SynthesisInputs) -> PromptFeatures:
        if inputs.voice_id is not None:
            voice = self.get(inputs.voice_id, inputs.owner)
            if inputs.prompt_text is not None:
                self.check_transcript(inputs.prompt_text, int(voice.speech_tokens.shape[0]))
                voice = PromptFeatures(embedding=voice.embedding, speech_tokens=voice.speech_tokens, mel=voice.mel,
                                       text=inputs.prompt_text, audio_sha256=voice.audio_sha256)
            return voice
        return self.from_audio(inputs.audio, inputs.prompt_text or "")

    def register(self, inputs: RegisterInputs) -> VoiceRecord:
        """Store the request's voice; the prompt encoder runs only when this recording and transcript are
        not stored yet (`register_once`)."""
        samples, rate = self.samples(inputs.audio)
        self.check_transcript(inputs.text, speech_tokens_of(samples.shape[0], rate))
        sha = audio_sha256(samples, rate)
        return register_once(self.store, sha, inputs.text, lambda: self.encoder.encode(samples, rate, inputs.text, sha),
                             voice_id=inputs.voice_id, name=inputs.name, owner=inputs.owner, family=self.family,
                             recording=Recording(samples, rate))


class ServedPipeline:
    """Parsed cosyvoice2 request -> float32 24 kHz chunks (the pipeline with the given stages)."""

    def __init__(self, model_dir: str | Path, voices: Voices, llm: LLMStage, token2wav: Token2WavStage,
                 max_text_chars: int, chunk_policy: ChunkPolicy = ChunkPolicy()):
        self.chunk_policy = chunk_policy  # the server's; a request may override its fields
        self.preprocessor = TextPreprocessor.from_model_dir(model_dir, max_chars=max_text_chars)
        self.default_sampling = SamplingParams.from_llm_yaml(read_yaml(ModelPaths(Path(model_dir)).yaml)["llm"])
        self.voices = voices
        self.pipeline = Pipeline(self.preprocessor, llm, token2wav)
        self.text_feeds = TextFeeds(idle_timeout_s=TEXT_IDLE_TIMEOUT_S)  # bistream syntheses by text_stream_id

    def request(self, inputs: SynthesisInputs) -> SynthesisRequest:
        """The library's request of a parsed one (checked by the parse, against this server's chunk policy; the
        mode against the voice once it is resolved)."""
        voice = self.voices.resolve(inputs)
        check_voice_serves(inputs.mode, voice)
        return SynthesisRequest(text=inputs.text, voice=voice, mode=inputs.mode,
                                instruct_text=inputs.instruct_text, seed=inputs.seed,
                                sampling=replace(self.default_sampling, **inputs.sampling),
                                chunk_policy=replace(self.chunk_policy, **inputs.chunk_overrides),
                                text_frontend=inputs.text_frontend, speed=inputs.speed,
                                text_type=inputs.text_type, voice_of=partial(self.voices.get, owner=inputs.owner),
                                marks=inputs.marks)

    def run(self, inputs: SynthesisInputs, stream: bool, is_cancelled: Callable[[], bool],
            stream_id: str | None = None) -> Iterator[np.ndarray]:
        if inputs.bistream:
            return self._bistream(inputs, stream, is_cancelled, stream_id)
        request = self.request(inputs)
        return self.pipeline.run(request, stream=stream, is_cancelled=is_cancelled, stream_id=stream_id)

    def run_bistream(self, inputs: SynthesisInputs, text: Iterable[str], stream: bool, is_cancelled: Callable[[], bool],
                     stream_id: str | None = None) -> Iterator[np.ndarray]:
        """text_mode bistream: `inputs.text` is the first piece, `text` yields the rest as it comes."""
        request = self.request(inputs)
        return self.pipeline.run_bistream(request, text, stream=stream, is_cancelled=is_cancelled,
                                          stream_id=stream_id)

    def append_text(self, append: TextAppend) -> None:
        """A text_append request: the piece goes to bistream synthesis `append.stream_id` of this process."""
        self.text_feeds.append(append.stream_id, append.text, append.end)

    def _bistream(self, inputs: SynthesisInputs, stream: bool, is_cancelled: Callable[[], bool],
                  stream_id: str | None) -> Iterator[np.ndarray]:
        feed = self.text_feeds.open(inputs.text_stream_id)
        try:
            yield from self.run_bistream(inputs, feed, stream, is_cancelled, stream_id)
        finally:
            self.text_feeds.close(inputs.text_stream_id)
