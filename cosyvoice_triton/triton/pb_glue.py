"""`pb_utils` glue for our model.py files (`pb_utils` is passed in as `pb`): a request's tensors, the outputs of
a BLS answer, and responses; any error as a `TritonError` with the right code and the error as data
(`CosyVoiceError.to_wire`: code, field, retry hint), which callers read with `errors.from_wire`.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from cosyvoice_triton.errors import CosyVoiceError, RemoteError, from_wire


def remote_error(model: str, message: str, status: int | str | None) -> RemoteError:
    """A callee's error answer as a RemoteError of its kind: `message` read with `from_wire`, `status` the
    callee's Triton error code (a pb_utils.TritonError number, or a status name)."""
    name = _CODE_NAMES.get(status) if isinstance(status, int) else status
    return RemoteError(from_wire(message, name), model, status)


def request_arrays(request) -> dict[str, np.ndarray]:
    """The inputs of a `pb_utils.InferenceRequest` by name (CPU numpy views)."""
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def response_arrays(pb, response, model: str) -> dict[str, np.ndarray]:
    """Outputs of a BLS response by name (copied: the response's memory may be reused);
    RemoteError if the callee answered with an error."""
    if response.has_error():
        error = response.error()
        code = error.code() if hasattr(error, "code") else None
        raise remote_error(model, error.message(), code)
    return {tensor.name(): np.array(tensor.as_numpy(), copy=True) for tensor in response.output_tensors()}


def output_tensors(pb, outputs: Mapping[str, np.ndarray]) -> list:
    return [pb.Tensor(name, np.ascontiguousarray(array)) for name, array in outputs.items()]


@dataclass(frozen=True)
class ErrorInfo:
    code_name: str  # a TritonError attribute: INVALID_ARG, NOT_FOUND, CANCELLED, UNAVAILABLE, INTERNAL
    message: str  # the error's `to_wire()` JSON


def library_error(exc: BaseException) -> CosyVoiceError:
    """`exc` as one of the library's errors: an unexpected exception becomes a short internal error (its
    details belong in the server log, not in an answer)."""
    if isinstance(exc, CosyVoiceError):
        return exc
    return CosyVoiceError(f"internal error ({type(exc).__name__})")


def classify(exc: BaseException) -> ErrorInfo:
    """The Triton error code and the wire message (`CosyVoiceError.to_wire`) for an exception."""
    error = library_error(exc)
    return ErrorInfo(error.triton_code, error.to_wire())


# TritonError codes as python_backend numbers them (pb_utils.TritonError.<NAME>).
_CODE_NAMES = {0: "UNKNOWN", 1: "INTERNAL", 2: "NOT_FOUND", 3: "INVALID_ARG", 4: "UNAVAILABLE",
               5: "UNSUPPORTED", 6: "ALREADY_EXISTS", 7: "CANCELLED"}


def triton_error(pb, exc: BaseException, model: str = ""):
    """`pb.TritonError` for `exc`. Internal errors are logged with their traceback (a callee's were logged
    where they happened)."""
    info = classify(exc)
    if info.code_name == "INTERNAL" and not isinstance(exc, RemoteError):
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        pb.Logger.log_error(f"{model}: {text}")
    return pb.TritonError(info.message, getattr(pb.TritonError, info.code_name, pb.TritonError.INTERNAL))


def error_response(pb, exc: BaseException, model: str = ""):
    return pb.InferenceResponse(error=triton_error(pb, exc, model))


def respond_each(pb, requests, model: str, outputs_of: Callable[[object], dict[str, np.ndarray]]) -> list:
    """One response per request of a non-decoupled `execute`: the tensors `outputs_of(request)` names, or
    that request's error. A bad request is answered on its own and never fails the others."""
    responses = []
    for request in requests:
        try:
            outputs = outputs_of(request)
            responses.append(pb.InferenceResponse(
                output_tensors=[pb.Tensor(name, array) for name, array in outputs.items()]))
        except Exception as exc:  # noqa: BLE001 - answered to this request only
            responses.append(error_response(pb, exc, model))
    return responses
