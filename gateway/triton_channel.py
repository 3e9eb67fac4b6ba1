"""The gateway's async gRPC to one Triton server (`TritonClient`): streaming synthesis (decoupled `cosyvoice2`),
unary infer, readiness; errors classified for routing (`TritonCallError`). The client SDK for users is
`cosyvoice_triton.client.triton_client`; both build their messages with `cosyvoice_triton.triton.wire`.

One `grpc.aio` channel per server; every synthesis request is its own `ModelStreamInfer` call carrying
one request (sent, then the client half-closes). Cancelling the call (the caller went away, a timeout)
cancels the request inside Triton: the model sees `is_cancelled()` and frees its LLM slot and
token2wav state. So the caller iterates `stream()` inside `contextlib.aclosing`, and a task that is
cancelled while waiting for a chunk cancels the call.

Triton reports a decoupled request's error as a message only (no status code), so `classify_message`
reads the model's convention: library errors say "<input name>: <problem>"; a full worker pool says
"... is busy ...". (Triton's `triton_grpc_error` header would carry the code as a gRPC status, but
tritonserver 2.51 crashed (SIGSEGV) after such a stream closed when we tried it; it is not used.)
"""
from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Mapping

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from cosyvoice_triton.triton import wire
from cosyvoice_triton.triton.wire import STREAM_END_WAIT_S, infer_request, response_outputs

CHANNEL_OPTIONS = [
    *wire.CHANNEL_OPTIONS,
    ("grpc.keepalive_time_ms", 20_000),  # notice a silently dead server during long streams
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
# Inputs of cosyvoice2 and register_voice: an error message starting with one of them names that field.
MODEL_INPUTS = frozenset({
    "target_text", "mode", "reference_audio_id", "reference_wav", "reference_sample_rate", "reference_audio",
    "reference_text", "instruct_text", "seed", "chunk_first_hop", "chunk_hop_scale", "chunk_max_hop", "chunk_policy",
    "top_p", "top_k", "win_size", "tau_r", "voice_id", "name",
})
_FIELD_MESSAGE = re.compile(r"^([a-z_]+): (.+)$", re.DOTALL)
_BUSY_WORDS = ("busy", "queue is full", "unavailable", "no free", "limit reached")


class TritonCallError(Exception):
    """A call to Triton failed.

    kind: unreachable (transport) | busy | timeout | invalid (a field) | not_found | cancelled | internal
    retryable: another server may succeed (only ever done before the first byte reached the client)
    """

    def __init__(self, kind: str, message: str, field: str | None = None, problem: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field
        self.problem = problem if problem is not None else message

    @property
    def retryable(self) -> bool:
        return self.kind in ("unreachable", "busy", "timeout")


def classify_message(message: str) -> TritonCallError:
    """A model's error message -> TritonCallError (see the module docstring)."""
    match = _FIELD_MESSAGE.match(message.strip())
    if match and match.group(1) in MODEL_INPUTS:
        field, problem = match.groups()
        kind = "not_found" if field == "reference_audio_id" and problem.startswith("no voice") else "invalid"
        return TritonCallError(kind, message, field, problem)
    if any(word in message.lower() for word in _BUSY_WORDS):
        return TritonCallError("busy", message)
    return TritonCallError("internal", message)


def rpc_error(error: grpc.aio.AioRpcError) -> TritonCallError:
    code, details = error.code(), error.details() or str(error.code())
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        classified = classify_message(details)
        return classified if classified.kind in ("invalid", "not_found") else TritonCallError("invalid", details)
    if code == grpc.StatusCode.NOT_FOUND:
        classified = classify_message(details)
        return classified if classified.field else TritonCallError("internal", details)  # e.g. model not loaded
    kind = {grpc.StatusCode.UNAVAILABLE: "unreachable", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
            grpc.StatusCode.CANCELLED: "cancelled", grpc.StatusCode.RESOURCE_EXHAUSTED: "busy"}.get(code, "internal")
    if kind == "unreachable" and "busy" in details.lower():
        kind = "busy"
    return TritonCallError(kind, f"{code.name}: {details}")


# ---- the client -----------------------------------------------------------------------------------------

async def await_end(call) -> None:
    """Let a `ModelStreamInfer` call whose final response (audio or an error) has come end on the server's
    side (our side closed after its one request): read to its EOF. A cancel there instead races Triton
    2.51's own end of the call, and a lost race leaves the request held in its gRPC frontend: the model
    can then never be unloaded, and tritonserver exits 1 at its exit timeout on every stop. (Dropping the
    call unread cancels it too: grpc cancels an unfinished call it collects.)"""
    try:
        async with asyncio.timeout(STREAM_END_WAIT_S):
            while await call.read() is not grpc.aio.EOF:
                pass
    except (TimeoutError, grpc.aio.AioRpcError):
        pass  # the caller cancels what did not end


class TritonClient:
    """Async calls to one server. Create and use it inside one event loop; `close()` when done."""

    def __init__(self, url: str):
        self.url = url
        self._channel = grpc.aio.insecure_channel(url, options=CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def stream(self, model: str, inputs: Mapping[str, np.ndarray], request_id: str = "", *,
                     first_timeout_s: float, chunk_timeout_s: float) -> AsyncIterator[np.ndarray]:
        """The request's `waveform` chunks as they come (float32, non-empty). Raises TritonCallError.
        Iterate it inside `contextlib.aclosing`: closing early, or cancelling the task, cancels the call."""
        request = infer_request(model, inputs, request_id, empty_final=True)

        async def one_request():
            yield request

        call = self._stub.ModelStreamInfer(one_request())
        produced = finished = False
        try:
            while True:
                timeout = chunk_timeout_s if produced else first_timeout_s
                try:
                    response = await asyncio.wait_for(call.read(), timeout)
                except asyncio.TimeoutError:
                    what = "the next audio chunk" if produced else "the first audio chunk"
                    raise TritonCallError("timeout", f"{self.url}: no {what} within {timeout:g} s") from None
                except grpc.aio.AioRpcError as error:
                    raise rpc_error(error) from None
                if response is grpc.aio.EOF:
                    raise TritonCallError("unreachable", f"{self.url}: the stream ended without a final response")
                if response.error_message:  # our models send an error as the request's final response
                    finished = True
                    raise classify_message(response.error_message)
                result = response.infer_response
                for tensor, raw in zip(result.outputs, result.raw_output_contents, strict=False):
                    if tensor.name == "waveform" and raw:
                        produced = True
                        yield np.frombuffer(raw, dtype=np.float32)
                if result.parameters["triton_final_response"].bool_param:
                    finished = True
                    return
        finally:
            try:
                if finished:
                    await await_end(call)
            finally:
                if not call.done():
                    call.cancel()

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray], timeout_s: float,
                    request_id: str = "") -> dict[str, np.ndarray]:
        try:
            response = await self._stub.ModelInfer(infer_request(model, inputs, request_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise rpc_error(error) from None
        return response_outputs(response)

    async def ready(self, model: str, timeout_s: float) -> bool:
        """Server live and ready, and `model` loaded."""
        try:
            server = await self._stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=timeout_s)
            if not server.ready:
                return False
            loaded = await self._stub.ModelReady(service_pb2.ModelReadyRequest(name=model), timeout=timeout_s)
            return bool(loaded.ready)
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        await self._channel.close(grace=None)
