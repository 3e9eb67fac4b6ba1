"""The gateway's async gRPC to one Triton server (`TritonClient`): streaming synthesis (decoupled `cosyvoice2`),
unary infer, readiness; errors classified for routing (`TritonCallError`). The client SDK for users is
`cosyvoice_triton.client.triton_client`; both build their messages with `cosyvoice_triton.triton.wire`.

One `grpc.aio` channel per server; every synthesis request is its own `ModelStreamInfer` call carrying
one request (sent, then the client half-closes). Cancelling the call (the caller went away, a timeout)
cancels the request inside Triton: the model sees `is_cancelled()` and frees its LLM slot and
token2wav state. So the caller iterates `stream()` inside `contextlib.aclosing`, and a task that is
cancelled while waiting for a chunk cancels the call. The call is read by `grpc_stream.AsyncStreamReader`,
the one reader of a decoupled call (final flag, end of the call, cancellation) that the SDK shares.

Triton reports a decoupled request's error as a message only (no status code), so our models send the
error as data (`CosyVoiceError.to_wire`: code, field, retry hint), read back with `errors.from_wire`, the
one reader; a gRPC status error of a call is read by it too, its status naming the kind. `TritonCallError`
carries that error, and its `kind` is the gateway's routing word for it. (Triton's `triton_grpc_error`
header would carry the code as a gRPC status, but tritonserver 2.51 crashed (SIGSEGV) after such a stream
closed when we tried it; it is not used.)
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.triton import wire
from cosyvoice_triton.triton.contracts import chunk_of, marks_of
from cosyvoice_triton.triton.grpc_stream import AsyncStreamReader, status_error
from cosyvoice_triton.triton.wire import infer_request, response_outputs

CHANNEL_OPTIONS = [
    *wire.CHANNEL_OPTIONS,
    ("grpc.keepalive_time_ms", 20_000),  # notice a silently dead server during long streams
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
# The gateway's routing word for each kind of library error (also the label of its `triton_<kind>` metric).
_KINDS = {"invalid_input": "invalid", "not_found": "not_found", "unavailable": "busy", "unreachable": "unreachable",
          "timeout": "timeout", "cancelled": "cancelled"}


class TritonCallError(Exception):
    """A call to Triton failed; `error` is the failure as the library's error (its code, field and retry
    hint), as `errors.from_wire` read it from the model or the call's status.

    kind: unreachable (transport) | busy | timeout | invalid (a field) | not_found | cancelled | internal
    retryable: another server may succeed (only ever done before the first byte reached the client)
    """

    def __init__(self, error: CosyVoiceError):
        super().__init__(error.message)
        self.error = error

    @property
    def kind(self) -> str:
        if self.error.code == "not_found" and self.error.field is None:
            return "internal"  # Triton's own NOT_FOUND (an unknown model) is the deployment's fault
        return _KINDS.get(self.error.code, "internal")

    @property
    def message(self) -> str:
        return self.error.message

    @property
    def field(self) -> str | None:
        return self.error.field

    @property
    def problem(self) -> str:
        """The message without its "field: " (an InvalidInput's or NotFound's problem)."""
        return getattr(self.error, "problem", self.error.message)

    @property
    def retry_after_s(self) -> int | None:
        return self.error.retry_after_s

    @property
    def retryable(self) -> bool:
        return self.kind in ("unreachable", "busy", "timeout")


def rpc_error(error: grpc.aio.AioRpcError) -> TritonCallError:
    """A failed call's gRPC status (our model's error JSON, or the status's own text) as a TritonCallError."""
    return TritonCallError(status_error(error))


# ---- the client -----------------------------------------------------------------------------------------

class TritonClient:
    """Async calls to one server. Create and use it inside one event loop; `close()` when done."""

    def __init__(self, url: str):
        self.url = url
        self._channel = grpc.aio.insecure_channel(url, options=CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def stream(self, model: str, inputs: Mapping[str, np.ndarray], request_id: str = "", *,
                     first_timeout_s: float, chunk_timeout_s: float) -> AsyncIterator[np.ndarray | dict]:
        """The request's `waveform` chunks as they come (float32, non-empty), each response's speech mark events
        (dicts, a request with speech_marks only) before its chunk. Raises TritonCallError.
        Iterate it inside `contextlib.aclosing`: closing early, or cancelling the task, cancels the call
        (`grpc_stream.AsyncStreamReader` reads it)."""
        request = infer_request(model, inputs, request_id, empty_final=True)

        async def one_request():
            yield request

        call = self._stub.ModelStreamInfer(one_request())
        responses = AsyncStreamReader(call, as_error=lambda error, _status: TritonCallError(error),
                                      first_timeout_s=first_timeout_s, next_timeout_s=chunk_timeout_s)
        async with aclosing(responses):
            async for outputs in responses:
                for event in marks_of(outputs):
                    yield event
                chunk = chunk_of(outputs)
                if chunk is not None:
                    yield chunk

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

    @property
    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        """The channel's Triton service as it is: for a caller that passes Triton's messages on unchanged
        (gateway/triton_facade.py)."""
        return self._stub

    async def close(self) -> None:
        await self._channel.close(grace=None)
