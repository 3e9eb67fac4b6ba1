"""Triton's gRPC messages from and to numpy: one implementation for every caller of a Triton server.

Used by the split frontend's token2wav calls (`remote_token2wav`), the client SDK and the gateway.
Requests carry every tensor in `raw_input_contents` (BYTES length-prefixed, as Triton expects), so no
`tritonclient` callback thread is needed and blocking and asyncio callers share the messages.
"""
from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np
from tritonclient.grpc import service_pb2

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   # A server that `up` restarted is found again within 2 s (gRPC's default backoff grows
                   # to 120 s while it is down, and health checks fail fast until the next attempt).
                   ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]
# After a stream's final response, how long a client waits for the server to end the ModelStreamInfer call
# with OK before it cancels it (call_reader.py, the reader of those calls, says why it waits).
STREAM_END_WAIT_S = 5.0
DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
             np.dtype(np.uint64): "UINT64", np.dtype(np.bool_): "BOOL"}
_DTYPES = {name: dtype for dtype, name in DATATYPES.items()}


def infer_request(model: str, values: Mapping[str, np.ndarray], request_id: str = "",
                  *, empty_final: bool = False) -> service_pb2.ModelInferRequest:
    """A `ModelInferRequest` with every tensor in `raw_input_contents` (BYTES length-prefixed).
    `empty_final`: ask a decoupled model for an empty final response (`triton_final_response`)."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, value in values.items():
        array = np.asarray(value)
        if array.dtype.kind in "OSU":
            datatype = "BYTES"
            raw = b"".join(struct.pack("<I", len(item)) + item
                           for item in (v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)))
        else:
            datatype = DATATYPES[array.dtype]
            raw = np.ascontiguousarray(array).tobytes()
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(raw)
    if empty_final:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def response_outputs(response: service_pb2.ModelInferResponse) -> dict[str, np.ndarray]:
    """Output name -> numpy array (BYTES outputs as arrays of `bytes`)."""
    outputs = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if tensor.datatype == "BYTES":
            items, pos = [], 0
            while pos < len(raw):
                (size,) = struct.unpack_from("<I", raw, pos)
                items.append(raw[pos + 4:pos + 4 + size])
                pos += 4 + size
            array = np.array(items, dtype=object)
        else:
            array = np.frombuffer(raw, dtype=_DTYPES[tensor.datatype])
        outputs[tensor.name] = array.reshape(list(tensor.shape)) if tensor.shape else array
    return outputs


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    """The last response of a decoupled request (`triton_final_response`)."""
    param = response.parameters.get("triton_final_response")
    return bool(param is not None and param.bool_param)
