"""The gateway's async gRPC to one Triton server (`TritonClient`): a streamed synthesis, a unary infer,
readiness. Every failure is a `RemoteError` carrying the server's error as the library's kind
(`errors.from_wire`); callers iterate `stream()` inside `contextlib.aclosing`, so that a caller that leaves
cancels the call (and the model frees the request's state). docs/architecture/wire.md says how a call is read.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from cosyvoice_triton.errors import RemoteError
from cosyvoice_triton.wire import grpc_messages
from cosyvoice_triton.wire.call_reader import AsyncCallReader, status_error
from cosyvoice_triton.wire.grpc_messages import infer_request, response_outputs
from cosyvoice_triton.wire.outputs import chunk_of, marks_of

CHANNEL_OPTIONS = [
    *grpc_messages.CHANNEL_OPTIONS,
    ("grpc.keepalive_time_ms", 20_000),  # notice a silently dead server during long streams
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
def rpc_error(error: grpc.aio.AioRpcError) -> RemoteError:
    """A failed call's gRPC status (our model's error JSON, or the status's own text) as a RemoteError."""
    return RemoteError(status_error(error), status=error)


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
        (dicts, a request with speech_marks only) before its chunk. Raises RemoteError.
        Iterate it inside `contextlib.aclosing`: closing early, or cancelling the task, cancels the call
        (`call_reader.AsyncCallReader` reads it)."""
        request = infer_request(model, inputs, request_id, empty_final=True)

        async def one_request():
            yield request

        call = self._stub.ModelStreamInfer(one_request())
        responses = AsyncCallReader(call, as_error=lambda error, _status: RemoteError(error),
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
