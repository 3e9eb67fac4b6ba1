"""Clients for the Triton models themselves, over gRPC: `TritonTTS` (blocking) and `AsyncTritonTTS` (asyncio).

```
from cosyvoice_triton.client import TritonTTS

with TritonTTS("localhost:8001") as tts:
    voice = tts.register_voice("me.wav", prompt_text="what I say in me.wav")
    with tts.stream("Hello there.", voice_id=voice.voice_id, seed=1) as chunks:
        for chunk in chunks:          # float32 numpy arrays at 24 kHz, as the server makes them
            play(chunk)               # leaving the block early cancels the request on the server
    audio = tts.synthesize("Hello there.", voice_id=voice.voice_id)
```

A stream is one gRPC `ModelStreamInfer` call carrying one request to the decoupled `cosyvoice2` model
(tensor contract: `cosyvoice_triton.triton.contracts`). Responses carry `waveform` chunks and end with
the empty final response (`triton_enable_empty_final_response`). Closing a stream before that cancels
the call, which Triton passes on to the model as a cancellation (its LLM slot and vocoder state are
freed). Errors (a bad field, an unknown voice, a busy server) raise `TTSError` with the field named.

Requests are built straight from Triton's protobuf messages, so the blocking and asyncio clients share
them, and the blocking client needs no callback thread of its own.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from cosyvoice_triton.messages import MODES
from cosyvoice_triton.triton import contracts
from cosyvoice_triton.triton.wire import CHANNEL_OPTIONS, infer_request, is_final, response_outputs

from .common import SAMPLE_RATE, PromptAudio, TTSError, VoiceInfo, as_samples, prompt_bytes

STREAMING_MODEL = contracts.COSYVOICE2
OFFLINE_MODEL = contracts.COSYVOICE2_OFFLINE
REGISTER_MODEL = contracts.REGISTER_VOICE


# ---- request tensors (built by `cosyvoice_triton.triton.contracts`) --------------------------------------

def _prompt(prompt_audio: PromptAudio | None, prompt_sample_rate: int | None) -> dict:
    """A prompt as `contracts.voice_inputs` takes it: samples (+ rate), or an audio file's bytes."""
    if prompt_audio is None:
        return {}
    if isinstance(prompt_audio, np.ndarray):
        if not prompt_sample_rate:
            raise ValueError("prompt_sample_rate is required with prompt samples")
        return {"samples": as_samples(prompt_audio), "sample_rate": prompt_sample_rate}
    return {"audio_file": prompt_bytes(prompt_audio)}


def synthesis_inputs(text: str, *, voice_id: str | None = None, prompt_audio: PromptAudio | None = None,
                     prompt_sample_rate: int | None = None, prompt_text: str | None = None,
                     mode: str | None = None, instruct: str | None = None, seed: int | None = None,
                     **overrides: float) -> dict[str, np.ndarray]:
    """The tensors of one `cosyvoice2` request, from the SDK's argument names."""
    if voice_id is None and prompt_audio is None:
        raise ValueError("a voice is required: voice_id or prompt_audio")
    if voice_id is not None and prompt_audio is not None:
        raise ValueError("give voice_id or prompt_audio, not both")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    unknown = [name for name in overrides if name not in contracts.OPTION_TYPES]
    if unknown:
        raise TypeError(f"unknown option {unknown[0]!r}; known: {', '.join(contracts.OPTION_TYPES)}")
    return contracts.synthesis_inputs(text, voice_id=voice_id, **_prompt(prompt_audio, prompt_sample_rate),
                                      prompt_text=prompt_text, mode=mode, instruct_text=instruct, seed=seed,
                                      **overrides)


def stream_request(model: str, text: str, request_id: str | None, **options) -> service_pb2.ModelInferRequest:
    """The `ModelStreamInfer` request of one synthesis (`options` as for `synthesis_inputs`); a fresh id
    when none is given."""
    return infer_request(model, synthesis_inputs(text, **options), request_id or uuid.uuid4().hex,
                         empty_final=True)


def _rpc_error(exc: grpc.RpcError) -> TTSError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return TTSError.from_message(details or str(code), status=code.name if code is not None else None)


def _register_result(response: service_pb2.ModelInferResponse, prompt_text: str | None,
                     name: str | None) -> VoiceInfo:
    out = response_outputs(response)
    return VoiceInfo(voice_id=out["voice_id"].reshape(-1)[0].decode(),
                     audio_sha256=out["audio_sha256"].reshape(-1)[0].decode(),
                     prompt_tokens=int(out["prompt_tokens"].reshape(-1)[0]), prompt_text=prompt_text, name=name)


def _register_values(audio: PromptAudio, sample_rate: int | None, prompt_text: str | None, voice_id: str | None,
                     name: str | None) -> dict[str, np.ndarray]:
    return contracts.register_inputs(voice_id=voice_id, name=name, **_prompt(audio, sample_rate),
                                     prompt_text=prompt_text)


@dataclass
class StreamStats:
    """What a finished (or closed) stream measured on the client."""

    chunks: int = 0
    samples: int = 0
    first_chunk_s: float | None = None  # from sending the request to the first audio chunk
    total_s: float | None = None

    @property
    def audio_seconds(self) -> float:
        return self.samples / SAMPLE_RATE

    def add(self, chunk: np.ndarray, started: float) -> None:
        if self.first_chunk_s is None:
            self.first_chunk_s = time.monotonic() - started
        self.chunks += 1
        self.samples += chunk.size


# ---- blocking client ---------------------------------------------------------------------------------

class _StreamResponses:
    """What the blocking and asyncio streams share: turning `ModelStreamInfer` responses into chunks."""

    def _begin(self, request: service_pb2.ModelInferRequest, done) -> None:
        self.request_id = request.id
        self.stats = StreamStats()
        self._done = done  # a threading or asyncio Event: set when our side of the call may close
        self._finished = False
        self._started = time.monotonic()

    def _chunk_of(self, response) -> np.ndarray | None:
        """The response's audio (None for a response without any); raises TTSError for an error response."""
        if response.error_message:
            self._finish()
            raise TTSError.from_message(response.error_message)
        chunk = response_outputs(response.infer_response).get("waveform")
        if is_final(response.infer_response):
            self._finish()
        if chunk is not None and chunk.size:
            self.stats.add(chunk, self._started)
            return chunk.astype(np.float32, copy=False)
        return None

    def _ended_early(self) -> TTSError:
        self._finish()
        return TTSError("the server closed the stream before the final response", status="UNAVAILABLE")

    def _failed(self, exc: grpc.RpcError) -> TTSError:
        self._finish()
        return _rpc_error(exc)

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.stats.total_s = time.monotonic() - self._started
            self._done.set()


class AudioStream(_StreamResponses, Iterator[np.ndarray]):
    """The chunks of one streaming request: float32 arrays (24 kHz mono), in order.

    `close()` (or leaving a `with` block, or dropping the iterator) before the end cancels the request.
    """

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub, request: service_pb2.ModelInferRequest,
                 timeout_s: float | None):
        self._begin(request, threading.Event())

        def requests():
            yield request
            self._done.wait()  # keep our side open until the last response (or a cancel)

        self._call = stub.ModelStreamInfer(requests(), timeout=timeout_s)

    def __iter__(self) -> AudioStream:
        return self

    def __next__(self) -> np.ndarray:
        while not self._finished:
            try:
                response = next(self._call)
            except StopIteration:
                raise self._ended_early() from None
            except grpc.RpcError as exc:
                raise self._failed(exc) from None
            chunk = self._chunk_of(response)
            if chunk is not None:
                return chunk
        raise StopIteration

    def close(self) -> None:
        """Cancel the request if it is still running."""
        if not self._finished:
            self._finish()
            self._call.cancel()

    @property
    def cancelled(self) -> bool:
        return self._call.cancelled()

    def __enter__(self) -> AudioStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class TritonTTS:
    """Blocking client of a CosyVoice2 Triton server's gRPC endpoint (`host:port`, default port 8001)."""

    def __init__(self, url: str = "localhost:8001", *, model: str = STREAMING_MODEL,
                 offline_model: str = OFFLINE_MODEL, register_model: str = REGISTER_MODEL,
                 timeout_s: float | None = 600.0):
        self.url = url.removeprefix("grpc://")
        self.model, self.offline_model, self.register_model = model, offline_model, register_model
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(self.url, options=CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def stream(self, text: str, *, voice_id: str | None = None, prompt_audio: PromptAudio | None = None,
               prompt_sample_rate: int | None = None, prompt_text: str | None = None, mode: str | None = None,
               instruct: str | None = None, seed: int | None = None, request_id: str | None = None,
               **overrides: float) -> AudioStream:
        """Start synthesizing `text`; iterate the result for its chunks as they are made."""
        request = stream_request(self.model, text, request_id, voice_id=voice_id, prompt_audio=prompt_audio,
                                 prompt_sample_rate=prompt_sample_rate, prompt_text=prompt_text, mode=mode,
                                 instruct=instruct, seed=seed, **overrides)
        return AudioStream(self._stub, request, self.timeout_s)

    def synthesize(self, text: str, *, offline: bool = False, **kwargs) -> np.ndarray:
        """The whole waveform: the stream's chunks joined, or (`offline=True`) one call to the offline twin."""
        if not offline:
            with self.stream(text, **kwargs) as chunks:
                return _join(list(chunks))
        request_id = kwargs.pop("request_id", None) or uuid.uuid4().hex
        values = synthesis_inputs(text, **kwargs)
        try:
            response = self._stub.ModelInfer(infer_request(self.offline_model, values, request_id),
                                             timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None
        return response_outputs(response)["waveform"].astype(np.float32, copy=False)

    def register_voice(self, audio: PromptAudio, *, sample_rate: int | None = None, prompt_text: str | None = None,
                       voice_id: str | None = None, name: str | None = None) -> VoiceInfo:
        """Register a voice from a recording (a file path, its bytes, or samples with `sample_rate`).
        Idempotent: the same recording and transcript give the same id."""
        values = _register_values(audio, sample_rate, prompt_text, voice_id, name)
        try:
            response = self._stub.ModelInfer(infer_request(self.register_model, values), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None
        return _register_result(response, prompt_text, name)

    def ready(self) -> bool:
        try:
            return self._stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=5).ready
        except grpc.RpcError:
            return False

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TritonTTS:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- asyncio client ----------------------------------------------------------------------------------

class AsyncAudioStream(_StreamResponses, AsyncIterator[np.ndarray]):
    """`AudioStream` for asyncio: `async for chunk in stream`; `await stream.aclose()` cancels."""

    def __init__(self, stub, request: service_pb2.ModelInferRequest, timeout_s: float | None):
        self._begin(request, asyncio.Event())

        async def requests():
            yield request
            await self._done.wait()

        self._call = stub.ModelStreamInfer(requests(), timeout=timeout_s)
        self._responses = self._call.__aiter__()

    def __aiter__(self) -> AsyncAudioStream:
        return self

    async def __anext__(self) -> np.ndarray:
        while not self._finished:
            try:
                response = await self._responses.__anext__()
            except StopAsyncIteration:
                raise self._ended_early() from None
            except grpc.RpcError as exc:
                raise self._failed(exc) from None
            chunk = self._chunk_of(response)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel the request if it is still running."""
        if not self._finished:
            self._finish()
            self._call.cancel()

    async def __aenter__(self) -> AsyncAudioStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncTritonTTS:
    """asyncio client of a CosyVoice2 Triton server's gRPC endpoint. Same methods as `TritonTTS`, awaited;
    `stream()` returns an `AsyncAudioStream` at once (no await)."""

    def __init__(self, url: str = "localhost:8001", *, model: str = STREAMING_MODEL,
                 offline_model: str = OFFLINE_MODEL, register_model: str = REGISTER_MODEL,
                 timeout_s: float | None = 600.0):
        self.url = url.removeprefix("grpc://")
        self.model, self.offline_model, self.register_model = model, offline_model, register_model
        self.timeout_s = timeout_s
        self._channel = None
        self._stub = None

    @property
    def stub(self):
        if self._stub is None:  # the channel belongs to the running event loop: made on first use
            self._channel = grpc.aio.insecure_channel(self.url, options=CHANNEL_OPTIONS)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    def stream(self, text: str, *, voice_id: str | None = None, prompt_audio: PromptAudio | None = None,
               prompt_sample_rate: int | None = None, prompt_text: str | None = None, mode: str | None = None,
               instruct: str | None = None, seed: int | None = None, request_id: str | None = None,
               **overrides: float) -> AsyncAudioStream:
        request = stream_request(self.model, text, request_id, voice_id=voice_id, prompt_audio=prompt_audio,
                                 prompt_sample_rate=prompt_sample_rate, prompt_text=prompt_text, mode=mode,
                                 instruct=instruct, seed=seed, **overrides)
        return AsyncAudioStream(self.stub, request, self.timeout_s)

    async def synthesize(self, text: str, *, offline: bool = False, **kwargs) -> np.ndarray:
        if not offline:
            async with self.stream(text, **kwargs) as chunks:
                return _join([chunk async for chunk in chunks])
        request_id = kwargs.pop("request_id", None) or uuid.uuid4().hex
        values = synthesis_inputs(text, **kwargs)
        try:
            response = await self.stub.ModelInfer(infer_request(self.offline_model, values, request_id),
                                                  timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None
        return response_outputs(response)["waveform"].astype(np.float32, copy=False)

    async def register_voice(self, audio: PromptAudio, *, sample_rate: int | None = None,
                             prompt_text: str | None = None, voice_id: str | None = None,
                             name: str | None = None) -> VoiceInfo:
        values = _register_values(audio, sample_rate, prompt_text, voice_id, name)
        try:
            response = await self.stub.ModelInfer(infer_request(self.register_model, values), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None
        return _register_result(response, prompt_text, name)

    async def ready(self) -> bool:
        try:
            return (await self.stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=5)).ready
        except grpc.RpcError:
            return False

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> AsyncTritonTTS:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _join(chunks: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
