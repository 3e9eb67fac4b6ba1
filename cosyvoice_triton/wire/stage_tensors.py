"""The tensors one model sends another inside a deployment: the `llm` and `token2wav` stages and the prompt
encoder's steps. Every builder here (the caller's) has its parser (the callee's) beside it. Models with
`max_batch_size > 0` (prompt_encoder and its steps, token2wav) get a leading batch dimension of 1 on every
tensor. Never imports torch: the prompt stays numpy until token2wav takes it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import SEED_LIMIT, ChunkRequest, FlowPrompt, LLMRequest, PromptFeatures, SamplingParams
from cosyvoice_triton.wire.names import (BISTREAM, CANCEL, EMBEDDING, FINALIZE, LEAD_S, PROMPT_MEL,
                                         PROMPT_SPEECH_TOKENS, PROMPT_TEXT_TOKENS, REFERENCE_SAMPLE_RATE,
                                         REFERENCE_WAV, SEED, SPEECH_TOKENS, SPEED, STREAM_ID, TAU_R, TEXT_APPEND,
                                         TEXT_END, TEXT_TOKENS, TOKENS, TOP_K, TOP_P, WAV16K, WIN_SIZE)
from cosyvoice_triton.wire.requests import TextAppend, read_sampling
from cosyvoice_triton.wire.tensors import TensorReader, string_array


@dataclass(frozen=True)
class StreamCancel:
    """A request to end stream `stream_id` (llm and token2wav)."""

    stream_id: str


def read_stream_id(reader: TensorReader) -> str:
    stream_id = reader.string(STREAM_ID, required=True)
    if not stream_id:
        raise InvalidInput(STREAM_ID, "must not be empty")
    return stream_id


# ---- llm ---------------------------------------------------------------------------------------------------

def llm_inputs(request: LLMRequest) -> dict[str, np.ndarray]:
    sampling = request.sampling
    values = {STREAM_ID: string_array(request.stream_id), TEXT_TOKENS: np.asarray(request.text_tokens, dtype=np.int32),
              SEED: np.array([request.seed], dtype=np.uint64),
              TOP_P: np.array([sampling.top_p], np.float32), TOP_K: np.array([sampling.top_k], np.int32),
              WIN_SIZE: np.array([sampling.win_size], np.int32), TAU_R: np.array([sampling.tau_r], np.float32)}
    if request.prompt_text_tokens:
        values[PROMPT_TEXT_TOKENS] = np.asarray(request.prompt_text_tokens, dtype=np.int32)
    if request.prompt_speech_tokens:
        values[PROMPT_SPEECH_TOKENS] = np.asarray(request.prompt_speech_tokens, dtype=np.int32)
    if request.bistream:
        values[BISTREAM] = np.array([True])
    if request.lead_s is not None:
        values[LEAD_S] = np.array([request.lead_s], dtype=np.float32)
    return values


def llm_append_inputs(stream_id: str, tokens: list[int], end: bool) -> dict[str, np.ndarray]:
    return {STREAM_ID: string_array(stream_id), TEXT_APPEND: np.array([True]),
            TEXT_TOKENS: np.asarray(tokens, dtype=np.int32), TEXT_END: np.array([end])}


def llm_cancel_inputs(stream_id: str) -> dict[str, np.ndarray]:
    return {STREAM_ID: string_array(stream_id), CANCEL: np.array([True])}


def parse_llm_request(reader: TensorReader,
                      default_sampling: SamplingParams) -> LLMRequest | StreamCancel | TextAppend:
    """An llm request, checked: a new stream (the model yaml's sampling filling what it leaves out), a cancel or
    a bistream append."""
    stream_id = read_stream_id(reader)
    if reader.boolean(CANCEL):
        return StreamCancel(stream_id)
    if reader.boolean(TEXT_APPEND):
        return TextAppend(stream_id, reader.token_ids(TEXT_TOKENS), reader.boolean(TEXT_END, default=False))
    seed = reader.integer(SEED, required=True, low=0, high=SEED_LIMIT - 1)
    bistream = reader.boolean(BISTREAM, default=False)
    lead_s = reader.real(LEAD_S)
    if lead_s is not None and not lead_s >= 0:
        raise InvalidInput(LEAD_S, f"must be >= 0 seconds, got {lead_s}")
    return LLMRequest(stream_id=stream_id, text_tokens=reader.token_ids(TEXT_TOKENS, required=not bistream),
                      prompt_text_tokens=reader.token_ids(PROMPT_TEXT_TOKENS),
                      prompt_speech_tokens=reader.token_ids(PROMPT_SPEECH_TOKENS),
                      sampling=replace(default_sampling, **read_sampling(reader)).validate(), seed=seed,
                      bistream=bistream, lead_s=lead_s)


def speech_tokens_outputs(tokens, batched: bool = False) -> dict[str, np.ndarray]:
    """The answer of llm (the tokens since the previous response) or, `batched` (1, N), of audio_tokenizer."""
    array = np.asarray(tokens, dtype=np.int32)
    return {SPEECH_TOKENS: array.reshape(1, -1) if batched else array.reshape(-1)}


def speech_tokens_from_outputs(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The `speech_tokens` of an llm or audio_tokenizer answer: (N,) int32."""
    return np.asarray(outputs[SPEECH_TOKENS], dtype=np.int32).reshape(-1)


# ---- token2wav ---------------------------------------------------------------------------------------------

def chunk_inputs(chunk: ChunkRequest) -> dict[str, np.ndarray]:
    """One token2wav request (batch dimension 1 on every tensor)."""
    values = {STREAM_ID: string_array(chunk.stream_id, batched=True),
              TOKENS: np.asarray(chunk.tokens, dtype=np.int32).reshape(1, -1),
              FINALIZE: np.array([[chunk.finalize]])}
    if chunk.seed is not None:
        values[SEED] = np.array([[chunk.seed]], dtype=np.uint64)
    if chunk.speed != 1.0:
        values[SPEED] = np.array([[chunk.speed]], dtype=np.float32)
    if chunk.prompt is not None:
        prompt = chunk.prompt
        values[PROMPT_SPEECH_TOKENS] = np.asarray(prompt.speech_tokens, dtype=np.int32).reshape(1, -1)
        values[PROMPT_MEL] = np.asarray(prompt.mel, dtype=np.float32)  # (1, 2P, 80)
        values[EMBEDDING] = np.asarray(prompt.embedding, dtype=np.float32).reshape(1, -1)
    return values


def token2wav_cancel_inputs(stream_id: str) -> dict[str, np.ndarray]:
    return {STREAM_ID: string_array(stream_id, batched=True), CANCEL: np.array([[True]])}


def parse_chunk(reader: TensorReader) -> ChunkRequest | StreamCancel:
    """A batched token2wav request (reader.batched is True); the prompt stays numpy (token2wav converts it)."""
    stream_id = read_stream_id(reader)
    if reader.boolean(CANCEL):
        return StreamCancel(stream_id)
    prompt = None
    names = (PROMPT_SPEECH_TOKENS, PROMPT_MEL, EMBEDDING)
    given = [name for name in names if reader.has(name)]
    if given:
        missing = [name for name in names if name not in given]
        if missing:
            raise InvalidInput(missing[0], f"is required with {', '.join(given)} (a stream's first chunk)")
        tokens = reader.array(PROMPT_SPEECH_TOKENS, np.int32, 1)
        mel = reader.array(PROMPT_MEL, np.float32, 2)
        embedding = reader.array(EMBEDDING, np.float32, 1)
        prompt = FlowPrompt(speech_tokens=tokens[None], mel=mel[None], embedding=embedding[None])
    return ChunkRequest(stream_id=stream_id, tokens=reader.token_ids(TOKENS),
                        finalize=reader.boolean(FINALIZE), prompt=prompt,
                        seed=reader.integer(SEED, low=0, high=SEED_LIMIT - 1),
                        speed=reader.real(SPEED, 1.0))


# ---- the prompt encoder and its steps ------------------------------------------------------------------------

def prompt_encoder_inputs(samples: np.ndarray, sample_rate: int) -> dict[str, np.ndarray]:
    return {REFERENCE_WAV: np.asarray(samples, dtype=np.float32).reshape(1, -1),
            REFERENCE_SAMPLE_RATE: np.array([[sample_rate]], dtype=np.int32)}


def align_prompt_features(embedding: np.ndarray, speech_tokens: np.ndarray, mel: np.ndarray, text: str,
                          audio_sha256: str, token_mel_ratio: int = 2) -> PromptFeatures:
    """Keep n = min(frames // ratio, tokens) tokens and ratio * n mel frames, as `PromptEncoder.encode`."""
    n_tokens = min(mel.shape[0] // token_mel_ratio, speech_tokens.shape[0])
    return PromptFeatures(embedding=np.ascontiguousarray(embedding.reshape(-1), dtype=np.float32),
                          speech_tokens=np.ascontiguousarray(speech_tokens.reshape(-1)[:n_tokens], dtype=np.int32),
                          mel=np.ascontiguousarray(mel[:token_mel_ratio * n_tokens], dtype=np.float32),
                          text=text, audio_sha256=audio_sha256)


def prompt_features_from_outputs(outputs: dict[str, np.ndarray], text: str, audio_sha256: str,
                                 token_mel_ratio: int = 2) -> PromptFeatures:
    """prompt_encoder's batched outputs (batch of 1) -> aligned PromptFeatures."""
    return align_prompt_features(outputs[EMBEDDING][0], outputs[SPEECH_TOKENS][0], outputs[PROMPT_MEL][0],
                                 text, audio_sha256, token_mel_ratio)


def read_prompt_audio_batch(reader: TensorReader) -> tuple[np.ndarray, int]:
    """prompt_audio's batched inputs -> (samples (N,) float32, rate)."""
    samples = reader.array(REFERENCE_WAV, np.float32, 1, required=True)
    rate = reader.integer(REFERENCE_SAMPLE_RATE, required=True, low=1, high=1_000_000)
    return samples, rate


def prompt_audio_outputs(wav16k: np.ndarray, mel: np.ndarray) -> dict[str, np.ndarray]:
    """prompt_audio's answer (batch of 1): the recording at 16 kHz (N,) and its prompt mel (T, 80)."""
    return {WAV16K: np.ascontiguousarray(wav16k, dtype=np.float32)[None],
            PROMPT_MEL: np.ascontiguousarray(mel, dtype=np.float32)[None]}


def wav16k_inputs(wav16k: np.ndarray) -> dict[str, np.ndarray]:
    """A speaker_embedding or audio_tokenizer request (batch of 1): (N,) float32 at 16 kHz."""
    return {WAV16K: np.asarray(wav16k, dtype=np.float32).reshape(1, -1)}


def read_wav16k(reader: TensorReader) -> np.ndarray:
    """The batched `wav16k` input of speaker_embedding and audio_tokenizer: (N,) float32 (finiteness unchecked)."""
    return reader.array(WAV16K, np.float32, 1, required=True)


def embedding_outputs(embedding) -> dict[str, np.ndarray]:
    """speaker_embedding's answer (batch of 1): the (192,) speaker embedding."""
    return {EMBEDDING: np.asarray(embedding).reshape(1, -1)}
