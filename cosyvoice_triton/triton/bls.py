"""BLS clients of our models, for code running inside a Python-backend model (`pb` = pb_utils).

`BlsLLM` and `BlsToken2Wav` are the pipeline's `LLMStage` and `Token2WavStage`: the same
`Pipeline.run` that drives the in-process stages drives the `llm` and `token2wav` models.
`BlsPromptEncoder` turns a reference recording into `PromptFeatures` through the `prompt_encoder`
ensemble. Calls block the calling thread, so callers run them in their own worker threads (never in a
decoupled model's `execute`).

Cancelling an LLM stream: python_backend 2.51 has no way to cancel a BLS request from the caller's side
(`InferenceResponseIterator.cancel()` came later), so the caller sends a second request to `llm` with
`cancel=true` and the stream's id; the LLM scheduler retires the stream at its next round and the stream ends
with its final response, which `cancel()` waits for. This requires the request to reach the instance
that holds the stream, hence one `llm` instance per server (see llm/config.pbtxt).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from cosyvoice_triton.messages import ChunkRequest, LLMRequest, PromptFeatures
from cosyvoice_triton.wire.names import (LLM, LLM_OUTPUTS, PROMPT_ENCODER, PROMPT_ENCODER_OUTPUTS, SPEECH_TOKENS,
                                         TOKEN2WAV, TOKEN2WAV_OUTPUTS)
from cosyvoice_triton.wire.stage_tensors import (chunk_inputs, llm_append_inputs, llm_cancel_inputs, llm_inputs,
                                                 prompt_encoder_inputs, prompt_features_from_outputs,
                                                 token2wav_cancel_inputs)
from cosyvoice_triton.wire.outputs import waveform_of
from cosyvoice_triton.triton.pb_glue import output_tensors, remote_error, response_arrays


def bls_request(pb, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]):
    return pb.InferenceRequest(model_name=model, inputs=output_tensors(pb, inputs),
                               requested_output_names=list(outputs))


def _check(response, model: str) -> None:
    if response.has_error():
        error = response.error()
        raise remote_error(model, error.message(), error.code() if hasattr(error, "code") else None)


class BlsTokenStream:
    """The speech tokens of one `llm` stream, as they come (a TokenStream)."""

    def __init__(self, pb, model: str, request: LLMRequest):
        self._pb = pb
        self._model = model
        self.stream_id = request.stream_id
        self._responses = bls_request(pb, model, llm_inputs(request), LLM_OUTPUTS).exec(
            decoupled=True)
        self._ended = False

    def __iter__(self) -> Iterator[list[int]]:
        for response in self._responses:
            _check(response, self._model)
            tensor = self._pb.get_output_tensor_by_name(response, SPEECH_TOKENS)
            if tensor is not None:
                tokens = tensor.as_numpy().reshape(-1).astype(np.int64).tolist()
                if tokens:
                    yield tokens
        self._ended = True

    def append_text(self, tokens: list[int], end: bool = False) -> None:
        """Bistream: more text for the live stream (a text_append request, answered by one empty final)."""
        for response in bls_request(self._pb, self._model, llm_append_inputs(self.stream_id, tokens, end),
                                    []).exec(decoupled=True):
            _check(response, self._model)

    def cancel(self) -> None:
        """End the stream in `llm` and wait for its last response, so its slot is free on return."""
        if self._ended:
            return
        for response in bls_request(self._pb, self._model, llm_cancel_inputs(self.stream_id),
                                    []).exec(decoupled=True):
            _check(response, self._model)
        for _ in self._responses:  # the cancelled stream's remaining responses, then its final one
            pass
        self._ended = True


class BlsLLM:
    def __init__(self, pb, model: str = LLM):
        self.pb = pb
        self.model = model

    def stream(self, request: LLMRequest) -> BlsTokenStream:
        return BlsTokenStream(self.pb, self.model, request)

    def close(self) -> None:
        pass


class BlsToken2Wav:
    def __init__(self, pb, model: str = TOKEN2WAV):
        self.pb = pb
        self.model = model

    def chunk(self, chunk: ChunkRequest) -> np.ndarray:
        response = bls_request(self.pb, self.model, chunk_inputs(chunk), TOKEN2WAV_OUTPUTS).exec()
        return waveform_of(response_arrays(self.pb, response, self.model))

    def cancel(self, stream_id: str) -> None:
        response = bls_request(self.pb, self.model, token2wav_cancel_inputs(stream_id),
                               TOKEN2WAV_OUTPUTS).exec()
        _check(response, self.model)


class BlsPromptEncoder:
    """Reference audio -> aligned PromptFeatures through the `prompt_encoder` ensemble."""

    def __init__(self, pb, model: str = PROMPT_ENCODER, token_mel_ratio: int = 2):
        self.pb = pb
        self.model = model
        self.token_mel_ratio = token_mel_ratio

    def encode(self, samples: np.ndarray, sample_rate: int, text: str, audio_sha256: str) -> PromptFeatures:
        response = bls_request(self.pb, self.model, prompt_encoder_inputs(samples, sample_rate),
                               PROMPT_ENCODER_OUTPUTS).exec()
        outputs = response_arrays(self.pb, response, self.model)
        return prompt_features_from_outputs(outputs, text, audio_sha256, self.token_mel_ratio)
