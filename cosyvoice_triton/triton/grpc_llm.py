"""The `llm` model over its own server's gRPC endpoint: `cosyvoice2`'s LLM stage (`LLMStage`). The token streams
never use BLS: Triton 2.51's Python backend can deadlock a model that reads decoupled BLS streams on several
threads (docs/operations/faults.md). Each stream, cancel and text piece is a `ModelStreamInfer` call of its own,
read by `CallReader`. The address comes from `SERVER_GRPC_ENV` (set by `TritonProcess`); without it (a
tritonserver started by hand) the BLS stage is used, with one warning line.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping

import numpy as np

from cosyvoice_triton.messages import LLMRequest
from cosyvoice_triton.wire.stage_tensors import llm_append_inputs, llm_cancel_inputs, llm_inputs
from cosyvoice_triton.wire.names import LLM, SPEECH_TOKENS
from cosyvoice_triton.wire.call_reader import CallReader

SERVER_GRPC_ENV = "COSYVOICE_SERVER_GRPC"  # host:port of the tritonserver a model runs in
CONTROL_TIMEOUT_S = 60.0  # a cancel or a text append is answered at the LLM's next round


class GrpcLLM:
    """`LLMStage` whose streams are gRPC calls to the `llm` model of the server at `target` (host:port)."""

    def __init__(self, target: str, model: str = LLM):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        from cosyvoice_triton.wire.grpc_messages import CHANNEL_OPTIONS

        self.target = target
        self.model = model
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def stream(self, request: LLMRequest) -> GrpcTokenStream:
        return GrpcTokenStream(self._stub, self.model, request)

    def close(self) -> None:
        self._channel.close()


class GrpcTokenStream:
    """The speech tokens of one `llm` stream, as they come (a `TokenStream`)."""

    def __init__(self, stub, model: str, request: LLMRequest):
        self._stub = stub
        self._model = model
        self.stream_id = request.stream_id
        self._ended = False
        self._appends = 0
        self._responses = _open(stub, model, llm_inputs(request), request.stream_id)
        if request.bistream:  # the model answers at once that the stream is open: text may come now
            next(self._responses)

    def __iter__(self) -> Iterator[list[int]]:
        for outputs in self._responses:
            tokens = outputs[SPEECH_TOKENS].reshape(-1).astype(np.int64).tolist()
            if tokens:
                yield tokens
        self._ended = True

    def append_text(self, tokens: list[int], end: bool = False) -> None:
        """Bistream: more text for the live stream (a text_append request, answered by one empty final)."""
        self._appends += 1
        _call(self._stub, self._model, llm_append_inputs(self.stream_id, tokens, end),
              f"{self.stream_id}/text/{self._appends}")

    def cancel(self) -> None:
        """End the stream in `llm` and wait for its last response, so its slot is free on return."""
        if self._ended:
            return
        _call(self._stub, self._model, llm_cancel_inputs(self.stream_id), f"{self.stream_id}/cancel")
        for _ in self._responses:  # the cancelled stream's remaining responses, then its final one
            pass
        self._ended = True


def _open(stub, model: str, values: Mapping[str, np.ndarray], request_id: str,
          timeout_s: float | None = None) -> CallReader:
    """One request on a `ModelStreamInfer` call of its own; our side stays open until its final response."""
    from cosyvoice_triton.wire.grpc_messages import infer_request

    done = threading.Event()

    def requests():
        yield infer_request(model, values, request_id, empty_final=True)
        done.wait()

    return CallReader(stub.ModelStreamInfer(requests(), timeout=timeout_s), on_end=done.set)


def _call(stub, model: str, values: Mapping[str, np.ndarray], request_id: str) -> None:
    """A request answered by one empty final response (or an error, raised)."""
    for _ in _open(stub, model, values, request_id, CONTROL_TIMEOUT_S):
        pass


def served_llm(pb, model: str = LLM):
    """The LLM stage of a model running inside tritonserver: over the server's gRPC endpoint when
    `SERVER_GRPC_ENV` names it, else BLS (with a warning: see the module docstring)."""
    target = os.environ.get(SERVER_GRPC_ENV)
    if target:
        return GrpcLLM(target, model)
    from cosyvoice_triton.triton.bls import BlsLLM

    pb.Logger.log_warn(f"{SERVER_GRPC_ENV} is not set: the LLM streams use decoupled BLS, which can deadlock "
                       f"Triton 2.51's Python backend under concurrent streams (start the server with "
                       f"`cosyvoice-triton serve`, or set {SERVER_GRPC_ENV}=host:port of its gRPC endpoint)")
    return BlsLLM(pb, model)
