"""The SDK's clients of the Triton models, over gRPC: `TritonTTS` (blocking) and `AsyncTritonTTS` (asyncio), with
the gateway clients' methods (docs/api/sdk.md). A stream is one `ModelStreamInfer` call carrying one request,
built as the wire package's types (`cosyvoice_triton.wire.requests`) and read by the one reader of a call
(`wire.call_reader`); closing it early cancels the request on the server. Errors raise `TTSError` with the
server's error data (code, field, retry hint). Never imports the server's packages (no torch).
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.pipeline.speech_marks import MarkList
from cosyvoice_triton.wire.call_reader import AsyncCallReader, CallReader, status_error, status_name
from cosyvoice_triton.wire.checks import check_one_voice
from cosyvoice_triton.wire.grpc_messages import CHANNEL_OPTIONS, infer_request, response_outputs
from cosyvoice_triton.wire.names import (BISTREAM, CHUNK_FIELDS, COSYVOICE2, COSYVOICE2_OFFLINE, MARKS, OPTION_TYPES,
                                         REGISTER_VOICE, SAMPLING_NAMES, SPEECH_MARKS, SPEED, TEXT_FRONTEND,
                                         TEXT_MODE, TEXT_STREAM_ID, TEXT_TYPE)
from cosyvoice_triton.wire.outputs import chunk_of, marks_of, parse_register_outputs, waveform_of
from cosyvoice_triton.wire.requests import (ConversionInputs, RegisterInputs, SynthesisInputs, TextAppend,
                                            chunk_overrides)
from cosyvoice_triton.wire.requests import PromptAudio as Recording

from .common import (SAMPLE_RATE, PromptAudio, TTSError, VoiceInfo, as_samples, prompt_bytes, source_recording,
                     with_marks)

STREAMING_MODEL = COSYVOICE2
OFFLINE_MODEL = COSYVOICE2_OFFLINE
REGISTER_MODEL = REGISTER_VOICE


# ---- requests (the wire package's types, from the SDK's argument names) -------------------------------------

def _recording(audio: PromptAudio | None, sample_rate: int | None, rate_name: str) -> Recording | None:
    """A recording as the wire takes it: samples (+ rate), or an audio file's bytes."""
    if audio is None:
        return None
    if isinstance(audio, np.ndarray):
        if not sample_rate:
            raise InvalidInput(rate_name, "is required with samples")
        return Recording(samples=as_samples(audio), sample_rate=sample_rate)
    return Recording(file_bytes=prompt_bytes(audio))


def _check_voice(voice_id: str | None, prompt_audio: PromptAudio | None) -> None:
    check_one_voice(voice_id, prompt_audio, "voice_id", "prompt_audio")


def _check_options(overrides: dict, known) -> None:
    unknown = [name for name in overrides if name not in known]
    if unknown:
        raise TypeError(f"unknown option {unknown[0]!r}; known: {', '.join(known)}")


def synthesis_request(text: str, *, voice_id: str | None = None, prompt_audio: PromptAudio | None = None,
                      prompt_sample_rate: int | None = None, prompt_text: str | None = None,
                      mode: str | None = None, instruct: str | None = None, seed: int | None = None,
                      marks: bool = False, **options) -> SynthesisInputs:
    """One `cosyvoice2` request from the SDK's argument names: `options` are option inputs by name
    (`OPTION_TYPES`: sampling, chunk policy, speed, ...; None: not sent), `marks` asks for speech marks."""
    _check_voice(voice_id, prompt_audio)
    _check_options(options, OPTION_TYPES)
    options = {name: value for name, value in options.items() if value is not None}
    return SynthesisInputs(
        text=text, mode=mode or "zero_shot", instruct_text=instruct or "", voice_id=voice_id,
        audio=_recording(prompt_audio, prompt_sample_rate, "prompt_sample_rate"), prompt_text=prompt_text, seed=seed,
        sampling={name: options[name] for name in SAMPLING_NAMES if name in options},
        chunk_overrides=chunk_overrides(options), text_frontend=options.get(TEXT_FRONTEND, True),
        speed=options.get(SPEED, 1.0), text_mode=options.get(TEXT_MODE, "sentences"),
        text_stream_id=options.get(TEXT_STREAM_ID), text_type=options.get(TEXT_TYPE),
        marks=marks or options.get(SPEECH_MARKS, False))


CONVERSION_OPTIONS = tuple(CHUNK_FIELDS)  # chunk_first_hop, ...: the chunk policy's overrides


def conversion_request(source_audio: PromptAudio | None = None, *, audio: PromptAudio | None = None,
                       sample_rate: int | None = None, voice_id: str | None = None,
                       prompt_audio: PromptAudio | None = None, prompt_sample_rate: int | None = None,
                       seed: int | None = None, speed: float | None = None, **options) -> ConversionInputs:
    """One voice conversion (`cosyvoice2` mode vc): the recording `source_audio` to speak again (a file path, its
    bytes, or samples at `sample_rate`; `audio`: the same) and the voice (`voice_id`, or a target recording
    `prompt_audio`)."""
    source = source_recording(source_audio, audio)
    _check_voice(voice_id, prompt_audio)
    _check_options(options, CONVERSION_OPTIONS)
    return ConversionInputs(source=_recording(source, sample_rate, "sample_rate"), voice_id=voice_id,
                            audio=_recording(prompt_audio, prompt_sample_rate, "prompt_sample_rate"), seed=seed,
                            chunk_overrides=chunk_overrides(options), speed=1.0 if speed is None else speed)


def stream_request(model: str, text: str, request_id: str | None, **options) -> service_pb2.ModelInferRequest:
    """The `ModelStreamInfer` request of one synthesis (`options` as for `synthesis_request`); a fresh id
    when none is given."""
    return _stream_request(model, synthesis_request(text, **options).tensors(), request_id)


def _stream_request(model: str, values: dict[str, np.ndarray], request_id: str | None) -> service_pb2.ModelInferRequest:
    return infer_request(model, values, request_id or uuid.uuid4().hex, empty_final=True)


def bistream_request(model: str, request_id: str | None, **options) -> service_pb2.ModelInferRequest:
    """The opening request of a bistream synthesis (text_mode bistream, no text yet; `options` as for
    `synthesis_request`): its id names the synthesis in the text_append requests that follow."""
    request_id = request_id or uuid.uuid4().hex
    return stream_request(model, "", request_id, text_mode=BISTREAM, text_stream_id=request_id, **options)


def _waveform(response: service_pb2.ModelInferResponse) -> np.ndarray:
    """The whole waveform of an offline model's answer (with its complete `marks` when it carries marks)."""
    outputs = response_outputs(response)
    audio = waveform_of(outputs)
    return with_marks(audio, marks_of(outputs)) if MARKS in outputs else audio


def _rpc_error(exc: grpc.RpcError) -> TTSError:
    return TTSError.from_error(status_error(exc), status=status_name(exc))


def _register_result(response: service_pb2.ModelInferResponse, prompt_text: str | None,
                     name: str | None) -> VoiceInfo:
    registered = parse_register_outputs(response_outputs(response))
    return VoiceInfo(voice_id=registered.voice_id, audio_sha256=registered.audio_sha256,
                     prompt_tokens=registered.prompt_tokens, prompt_text=prompt_text, name=name)


def _register_values(audio: PromptAudio, sample_rate: int | None, prompt_text: str | None, voice_id: str | None,
                     name: str | None) -> dict[str, np.ndarray]:
    return RegisterInputs(audio=_recording(audio, sample_rate, "sample_rate"), text=prompt_text or "",
                          voice_id=voice_id, name=name).tensors()


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
    """What the blocking and asyncio streams share around their `call_reader`: the request's id, its
    stats, the event that closes our side of the call when the reading ends, a response's chunk."""

    def _begin(self, request: service_pb2.ModelInferRequest, done) -> None:
        self.request_id = request.id
        self.stats = StreamStats()
        self._marked = any(tensor.name == SPEECH_MARKS for tensor in request.inputs)
        self._marks = MarkList()
        self._events: list[dict] = []  # mark events waiting for the next chunk
        self._done = done  # a threading or asyncio Event: set when our side of the call may close
        self._started = time.monotonic()

    def _reader_options(self) -> dict:
        return {"skip": self._is_append_answer, "on_end": self._finish, "as_error": TTSError.from_error}

    def _is_append_answer(self, result: service_pb2.ModelInferResponse) -> bool:
        """A bistream text_append's own (empty, final) answer."""
        return result.id.startswith(_append_prefix(self.request_id))

    def _chunk(self, outputs: dict[str, np.ndarray]) -> np.ndarray | None:
        """A response's audio, None when it has none; with marks asked for, the events that came since the
        previous chunk in its `marks`."""
        events = marks_of(outputs)
        self._marks.extend(events)
        self._events.extend(events)
        chunk = chunk_of(outputs)
        if chunk is not None:
            self.stats.add(chunk, self._started)
            if self._marked:
                chunk, self._events = with_marks(chunk, self._events), []
        return chunk

    @property
    def marks(self) -> list[dict]:
        """The complete speech marks received so far (all of them once the stream is over)."""
        return self._marks.marks

    @property
    def marked(self) -> bool:
        """Whether the request asked for speech marks."""
        return self._marked

    def _finish(self) -> None:
        self.stats.total_s = time.monotonic() - self._started
        self._done.set()


class AudioStream(_StreamResponses, Iterator[np.ndarray]):
    """The chunks of one streaming request: float32 arrays (24 kHz mono), in order.

    `close()` (or leaving a `with` block, or dropping the iterator) before the end cancels the request.
    """

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub, request: service_pb2.ModelInferRequest,
                 timeout_s: float | None):
        self._begin(request, threading.Event())
        self._call = stub.ModelStreamInfer(self._requests(request), timeout=timeout_s)
        self._responses = CallReader(self._call, **self._reader_options())

    def _requests(self, request: service_pb2.ModelInferRequest) -> Iterator[service_pb2.ModelInferRequest]:
        yield request
        self._done.wait()  # keep our side open until the last response (or a cancel)

    def __iter__(self) -> AudioStream:
        return self

    def __next__(self) -> np.ndarray:
        for outputs in self._responses:
            chunk = self._chunk(outputs)
            if chunk is not None:
                return chunk
        raise StopIteration

    def close(self) -> None:
        """Cancel the request if it is still running."""
        self._responses.close()

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
        except Exception:  # noqa: BLE001 - interpreter shutdown, or a stream that never started
            pass


def _append_prefix(request_id: str) -> str:
    return f"{request_id}/text/"


def _text_append(request: service_pb2.ModelInferRequest, index: int, piece: str,
                 end: bool = False) -> service_pb2.ModelInferRequest:
    """The text_append request carrying bistream `request`'s piece `index` (1, 2, ...; `end` after the last)."""
    values = TextAppend(request.id, piece, end).tensors()
    return infer_request(request.model_name, values, f"{_append_prefix(request.id)}{index}")


class TextAudioStream(AudioStream):
    """The chunks of one bistream synthesis whose text comes from an iterator as it is written (an LLM
    streaming its answer): one `ModelStreamInfer` call carries the opening request (text_mode bistream),
    then a text_append request per piece as the iterator yields it, and one with text_end after the
    last. The audio starts before the text is complete; iterate and close as an `AudioStream`."""

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub, request: service_pb2.ModelInferRequest,
                 text: Iterable[str], timeout_s: float | None):
        self._text = text
        super().__init__(stub, request, timeout_s)

    def _requests(self, request: service_pb2.ModelInferRequest) -> Iterator[service_pb2.ModelInferRequest]:
        yield request
        count = 0
        for count, piece in enumerate(self._text, start=1):
            if self._done.is_set():
                return
            yield _text_append(request, count, piece)
        yield _text_append(request, count + 1, "", end=True)
        self._done.wait()  # keep our side open until the last response (or a cancel)


class _Settings:
    """Where the clients send their requests: the endpoint, the three models, the per-call timeout."""

    def __init__(self, url: str = "localhost:8001", *, model: str = STREAMING_MODEL,
                 offline_model: str = OFFLINE_MODEL, register_model: str = REGISTER_MODEL,
                 timeout_s: float | None = 600.0):
        self.url = url.removeprefix("grpc://")
        self.model, self.offline_model, self.register_model = model, offline_model, register_model
        self.timeout_s = timeout_s


class TritonTTS(_Settings):
    """Blocking client of a CosyVoice2 Triton server's gRPC endpoint (`host:port`, default port 8001); keywords
    `model`, `offline_model`, `register_model`, `timeout_s` as `_Settings`."""

    def __init__(self, url: str = "localhost:8001", **settings):
        super().__init__(url, **settings)
        self._channel = grpc.insecure_channel(self.url, options=CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def stream(self, text: str, *, voice_id: str | None = None, prompt_audio: PromptAudio | None = None,
               prompt_sample_rate: int | None = None, prompt_text: str | None = None, mode: str | None = None,
               instruct: str | None = None, seed: int | None = None, request_id: str | None = None,
               **overrides: float) -> AudioStream:
        """Start synthesizing `text`; iterate the result for its chunks as they are made. `overrides`: any option
        input (`wire.names.OPTION_TYPES`): speed, chunk_*, sampling, text_type ("ssml": docs/api/ssml.md); and
        `marks=True`: speech marks, each chunk's in `chunk.marks`, all of them in the stream's `marks`."""
        request = stream_request(self.model, text, request_id, voice_id=voice_id, prompt_audio=prompt_audio,
                                 prompt_sample_rate=prompt_sample_rate, prompt_text=prompt_text, mode=mode,
                                 instruct=instruct, seed=seed, **overrides)
        return AudioStream(self._stub, request, self.timeout_s)

    def stream_text(self, text: Iterable[str], *, voice_id: str | None = None,
                    prompt_audio: PromptAudio | None = None, prompt_sample_rate: int | None = None,
                    prompt_text: str | None = None, mode: str | None = None, instruct: str | None = None,
                    seed: int | None = None, request_id: str | None = None, **overrides: float) -> TextAudioStream:
        """Bistream: synthesize the text that `text` yields in pieces as it is written (one LLM stream reads
        it as it comes), audio starting before the text is complete. The pieces are read from the gRPC
        call's own thread, as the server takes them."""
        request = bistream_request(self.model, request_id, voice_id=voice_id, prompt_audio=prompt_audio,
                                   prompt_sample_rate=prompt_sample_rate, prompt_text=prompt_text, mode=mode,
                                   instruct=instruct, seed=seed, **overrides)
        return TextAudioStream(self._stub, request, text, self.timeout_s)

    def synthesize(self, text: str, *, offline: bool = False, **kwargs) -> np.ndarray:
        """The whole waveform: the stream's chunks joined, or (`offline=True`) one call to the offline twin.
        With `marks=True`, the complete speech marks in its `marks`."""
        if not offline:
            with self.stream(text, **kwargs) as chunks:
                audio = _join(list(chunks))
            return with_marks(audio, chunks.marks) if chunks.marked else audio
        request_id = kwargs.pop("request_id", None)
        return _waveform(self._infer(self.offline_model, synthesis_request(text, **kwargs).tensors(), request_id))

    def convert(self, source_audio: PromptAudio | None = None, *, request_id: str | None = None,
                **options) -> np.ndarray:
        """Voice conversion (mode vc, the official inference_vc): the recording `source_audio` (a file path, its
        bytes, or samples at `sample_rate`; `audio`: the same) spoken again in a voice, the whole waveform
        (float32, 24 kHz) from one call to the offline twin (each piece of the source in one full-attention flow
        pass, as /v1/vc's stream false). Options as `GatewayTTS.convert`: voice_id | prompt_audio (a target
        recording; + prompt_sample_rate for samples), seed, speed, sample_rate; and the chunk policy
        (`chunk_first_hop`, ...)."""
        values = conversion_request(source_audio, **options).tensors()
        return _waveform(self._infer(self.offline_model, values, request_id))

    def convert_stream(self, source_audio: PromptAudio | None = None, *, request_id: str | None = None,
                       **options) -> AudioStream:
        """Voice conversion streamed (the chunk schedule of a sentence per piece, as /v1/vc's stream true);
        options as `convert`."""
        request = _stream_request(self.model, conversion_request(source_audio, **options).tensors(), request_id)
        return AudioStream(self._stub, request, self.timeout_s)

    def register_voice(self, audio: PromptAudio, *, sample_rate: int | None = None, prompt_text: str | None = None,
                       voice_id: str | None = None, name: str | None = None) -> VoiceInfo:
        """Register a voice from a recording (a file path, its bytes, or samples with `sample_rate`).
        Idempotent: the same recording and transcript give the same id."""
        values = _register_values(audio, sample_rate, prompt_text, voice_id, name)
        return _register_result(self._infer(self.register_model, values), prompt_text, name)

    def _infer(self, model: str, values: dict[str, np.ndarray],
               request_id: str | None = None) -> service_pb2.ModelInferResponse:
        """One `ModelInfer` call (a fresh request id when none is given); errors as TTSError."""
        try:
            return self._stub.ModelInfer(infer_request(model, values, request_id or uuid.uuid4().hex),
                                         timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None

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
        self._call = stub.ModelStreamInfer(self._requests(request), timeout=timeout_s)
        self._responses = AsyncCallReader(self._call, **self._reader_options())

    async def _requests(self, request: service_pb2.ModelInferRequest) -> AsyncIterator[service_pb2.ModelInferRequest]:
        yield request
        await self._done.wait()  # keep our side open until the last response (or a cancel)

    def __aiter__(self) -> AsyncAudioStream:
        return self

    async def __anext__(self) -> np.ndarray:
        async for outputs in self._responses:
            chunk = self._chunk(outputs)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel the request if it is still running."""
        await self._responses.aclose()

    async def __aenter__(self) -> AsyncAudioStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncTextAudioStream(AsyncAudioStream):
    """`TextAudioStream` for asyncio: the text pieces come from an async iterable (or a plain one, read in the
    event loop) as the call sends them."""

    def __init__(self, stub, request: service_pb2.ModelInferRequest, text: Iterable[str] | AsyncIterable[str],
                 timeout_s: float | None):
        self._text = text
        super().__init__(stub, request, timeout_s)

    async def _requests(self, request: service_pb2.ModelInferRequest) -> AsyncIterator[service_pb2.ModelInferRequest]:
        yield request
        count = 0
        async for piece in _pieces(self._text):
            if self._done.is_set():
                return
            count += 1
            yield _text_append(request, count, piece)
        yield _text_append(request, count + 1, "", end=True)
        await self._done.wait()


async def _pieces(text: Iterable[str] | AsyncIterable[str]) -> AsyncIterator[str]:
    if isinstance(text, AsyncIterable):
        async for piece in text:
            yield piece
    else:
        for piece in text:
            yield piece


class AsyncTritonTTS(_Settings):
    """asyncio client of a CosyVoice2 Triton server's gRPC endpoint. Same methods as `TritonTTS`, awaited;
    `stream()`, `stream_text()` and `convert_stream()` return their stream at once (no await)."""

    def __init__(self, url: str = "localhost:8001", **settings):
        super().__init__(url, **settings)
        self._channel = None
        self._stub = None

    @property
    def stub(self):
        if self._stub is None:  # the channel belongs to the running event loop: made on first use
            self._channel = grpc.aio.insecure_channel(self.url, options=CHANNEL_OPTIONS)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    def stream(self, text: str, *, request_id: str | None = None, **options) -> AsyncAudioStream:
        """Start synthesizing `text`, as `TritonTTS.stream` (same options)."""
        return AsyncAudioStream(self.stub, stream_request(self.model, text, request_id, **options), self.timeout_s)

    def stream_text(self, text: Iterable[str] | AsyncIterable[str], *, request_id: str | None = None,
                    **options) -> AsyncTextAudioStream:
        """Bistream, as `TritonTTS.stream_text` (same options): the pieces of `text`, an async iterable (an LLM's
        streamed answer) or a plain one, are sent as it yields them."""
        return AsyncTextAudioStream(self.stub, bistream_request(self.model, request_id, **options), text,
                                    self.timeout_s)

    async def synthesize(self, text: str, *, offline: bool = False, **kwargs) -> np.ndarray:
        if not offline:
            async with self.stream(text, **kwargs) as chunks:
                audio = _join([chunk async for chunk in chunks])
            return with_marks(audio, chunks.marks) if chunks.marked else audio
        request_id = kwargs.pop("request_id", None)
        return _waveform(await self._infer(self.offline_model, synthesis_request(text, **kwargs).tensors(), request_id))

    async def convert(self, source_audio: PromptAudio | None = None, *, request_id: str | None = None,
                      **options) -> np.ndarray:
        """Voice conversion, the whole waveform, as `TritonTTS.convert`."""
        values = conversion_request(source_audio, **options).tensors()
        return _waveform(await self._infer(self.offline_model, values, request_id))

    def convert_stream(self, source_audio: PromptAudio | None = None, *, request_id: str | None = None,
                       **options) -> AsyncAudioStream:
        """Voice conversion streamed, as `TritonTTS.convert_stream`."""
        request = _stream_request(self.model, conversion_request(source_audio, **options).tensors(), request_id)
        return AsyncAudioStream(self.stub, request, self.timeout_s)

    async def register_voice(self, audio: PromptAudio, *, sample_rate: int | None = None,
                             prompt_text: str | None = None, voice_id: str | None = None,
                             name: str | None = None) -> VoiceInfo:
        values = _register_values(audio, sample_rate, prompt_text, voice_id, name)
        return _register_result(await self._infer(self.register_model, values), prompt_text, name)

    async def _infer(self, model: str, values: dict[str, np.ndarray],
                     request_id: str | None = None) -> service_pb2.ModelInferResponse:
        try:
            return await self.stub.ModelInfer(infer_request(model, values, request_id or uuid.uuid4().hex),
                                              timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None

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
