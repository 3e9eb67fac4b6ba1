"""Voice conversion inside the `cosyvoice2` model (mode "vc"), without `pb_utils` of its own.

`ConversionService` turns parsed `ConversionInputs` into audio chunks with the library's `VoiceConverter`:
the voice resolved as for synthesis (`Voices`: a stored id, or a prompt recording through prompt_encoder),
the source's speech tokens from the `audio_tokenizer` model (`BlsAudioTokenizer`), and its chunks through the
same token2wav stage as synthesis (this server's `token2wav` over BLS, or the backend servers').
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np

from cosyvoice_triton.messages import ChunkPolicy, ConversionRequest
from cosyvoice_triton.preprocess.audio import decode_audio, to_mono
from cosyvoice_triton.pipeline.stages import Token2WavStage
from cosyvoice_triton.pipeline.voice_conversion import VoiceConverter
from cosyvoice_triton.wire.names import AUDIO_TOKENIZER, AUDIO_TOKENIZER_OUTPUTS, SOURCE_AUDIO
from cosyvoice_triton.wire.stage_tensors import speech_tokens_from_outputs, wav16k_inputs
from cosyvoice_triton.triton.bls import bls_request
from cosyvoice_triton.wire.requests import ConversionInputs, SynthesisInputs
from cosyvoice_triton.triton.service import Voices
from cosyvoice_triton.triton.pb_glue import response_arrays


class BlsAudioTokenizer:
    """(N,) float32 at 16 kHz -> S3 speech tokens, through the `audio_tokenizer` model (batch of one)."""

    def __init__(self, pb, model: str = AUDIO_TOKENIZER):
        self.pb = pb
        self.model = model

    def __call__(self, wav16k: np.ndarray) -> np.ndarray:
        response = bls_request(self.pb, self.model, wav16k_inputs(wav16k),
                               AUDIO_TOKENIZER_OUTPUTS).exec()
        return speech_tokens_from_outputs(response_arrays(self.pb, response, self.model))


class ConversionService:
    """Parsed vc request -> float32 24 kHz chunks in the resolved voice."""

    def __init__(self, voices: Voices, tokenize: Callable[[np.ndarray], np.ndarray], token2wav: Token2WavStage,
                 chunk_policy: ChunkPolicy = ChunkPolicy()):
        self.voices = voices
        self.chunk_policy = chunk_policy  # the server's; a request may override its fields
        self.converter = VoiceConverter(tokenize, token2wav)

    def request(self, inputs: ConversionInputs) -> ConversionRequest:
        source = inputs.source
        if source.file_bytes is not None:
            samples, rate = decode_audio(source.file_bytes, field=SOURCE_AUDIO)
        else:
            samples, rate = to_mono(source.samples), int(source.sample_rate)
        voice = self.voices.resolve(SynthesisInputs(text="", voice_id=inputs.voice_id, audio=inputs.audio,
                                                              owner=inputs.owner))
        return ConversionRequest(source=samples, sample_rate=rate, voice=voice, seed=inputs.seed,
                                 chunk_policy=replace(self.chunk_policy, **inputs.chunk_overrides), speed=inputs.speed)

    def run(self, inputs: ConversionInputs, stream: bool, is_cancelled: Callable[[], bool],
            stream_id: str | None = None) -> Iterator[np.ndarray]:
        request = self.request(inputs)
        return self.converter.run(request, stream=stream, is_cancelled=is_cancelled, stream_id=stream_id)
