"""Tensors in and out of our Triton models, and errors as Triton errors; `pb_utils` is passed in.

`TensorReader` reads the inputs of one request (a name -> numpy array mapping, so it is testable
without Triton) into Python values, and every problem it finds is an `InvalidInput` naming the input.
For a model with `max_batch_size > 0` each request carries a leading batch dimension of 1, which
`batched=True` strips. `triton_error` turns any exception into a `TritonError` with the right code and the
error as data (`CosyVoiceError.to_wire`: code, field, retry hint), which callers read with `errors.from_wire`.
"""
from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from cosyvoice_triton.errors import CosyVoiceError, InvalidInput, from_wire

log = logging.getLogger(__name__)

_KIND_NAMES = {"b": "BOOL", "i": "INT", "u": "UINT", "f": "FP", "O": "STRING", "S": "STRING", "U": "STRING"}


class RemoteError(CosyVoiceError):
    """An error response from a model we called (BLS, or gRPC to another server), as the callee's kind: its
    `code`, `field`, `retry_after_s` and Triton code are read from the message with `from_wire`.
    `status`: the callee's Triton error code (a pb_utils.TritonError number, or a status name), `error`: the
    callee's error as its own class (an Unavailable, an InvalidInput, ...)."""

    def __init__(self, model: str, message: str, status: int | str | None):
        self.model = model
        self.status = status
        self.error = from_wire(message, _CODE_NAMES.get(status) if isinstance(status, int) else status)
        super().__init__(self.error.message, field=self.error.field, retry_after_s=self.error.retry_after_s)
        self.code, self.triton_code = self.error.code, self.error.triton_code


class TensorReader:
    """Typed access to one request's inputs. `batched`: strip the leading batch dimension of 1."""

    def __init__(self, arrays: Mapping[str, np.ndarray], batched: bool = False):
        self.arrays = dict(arrays)
        self.batched = batched

    def has(self, name: str) -> bool:
        return name in self.arrays

    def raw(self, name: str) -> np.ndarray | None:
        array = self.arrays.get(name)
        if array is None:
            return None
        if self.batched:
            if array.ndim == 0 or array.shape[0] != 1:
                raise InvalidInput(name, f"expected a batch of one request, got shape {list(array.shape)}")
            array = array[0]
        return array

    def _scalar(self, name: str):
        array = self.raw(name)
        if array is None:
            return None
        if array.size != 1:
            raise InvalidInput(name, f"expected one value, got shape {list(array.shape)}")
        return array.reshape(-1)[0]

    def string(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        value = self._scalar(name)
        if value is None:
            if required:
                raise InvalidInput(name, "is required")
            return default
        if isinstance(value, (bytes, np.bytes_)):
            try:
                return bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInput(name, "is not valid UTF-8") from None
        if isinstance(value, str):
            return value
        raise InvalidInput(name, f"must be a string, got {_dtype_name(np.asarray(value).dtype)}")

    def blob(self, name: str) -> bytes | None:
        """A STRING input holding raw bytes (a file), not text."""
        value = self._scalar(name)
        if value is None:
            return None
        if isinstance(value, (bytes, np.bytes_)):
            return bytes(value)
        raise InvalidInput(name, "must be bytes")

    def integer(self, name: str, default: int | None = None, required: bool = False,
                low: int | None = None, high: int | None = None) -> int | None:
        value = self._scalar(name)
        if value is None:
            if required:
                raise InvalidInput(name, "is required")
            return default
        if not isinstance(value, np.integer) or isinstance(value, np.bool_):
            raise InvalidInput(name, f"must be an integer, got {_dtype_name(np.asarray(value).dtype)}")
        value = int(value)
        if (low is not None and value < low) or (high is not None and value > high):
            raise InvalidInput(name, f"must be in [{low}, {high}], got {value}")
        return value

    def real(self, name: str, default: float | None = None) -> float | None:
        value = self._scalar(name)
        if value is None:
            return default
        if not isinstance(value, (np.floating, np.integer)) or isinstance(value, np.bool_):
            raise InvalidInput(name, f"must be a number, got {_dtype_name(np.asarray(value).dtype)}")
        # FP32 inputs: the shortest decimal that the float32 stands for (0.1, not 0.10000000149), so that
        # a value such as tau_r = 0.1 arrives as the Python float the library's defaults use.
        value = float(str(value)) if isinstance(value, np.float32) else float(value)
        if not np.isfinite(value):
            raise InvalidInput(name, f"must be finite, got {value}")
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self._scalar(name)
        if value is None:
            return default
        if not isinstance(value, np.bool_):
            raise InvalidInput(name, f"must be BOOL, got {_dtype_name(np.asarray(value).dtype)}")
        return bool(value)

    def array(self, name: str, dtype, ndim: int, required: bool = False) -> np.ndarray | None:
        """A numeric array of `ndim` dimensions (after the batch dimension), with the config's dtype."""
        array = self.raw(name)
        if array is None:
            if required:
                raise InvalidInput(name, "is required")
            return None
        if array.dtype != np.dtype(dtype):
            raise InvalidInput(name, f"must be {_dtype_name(np.dtype(dtype))}, got {_dtype_name(array.dtype)}")
        if array.ndim != ndim:
            raise InvalidInput(name, f"expected {ndim} dimension(s), got shape {list(array.shape)}")
        return array

    def token_ids(self, name: str, required: bool = False) -> list[int]:
        """An INT32 [-1] input as a list of ints; absent and optional -> []."""
        array = self.array(name, np.int32, 1, required=required)
        return [] if array is None else array.astype(np.int64).tolist()


def _dtype_name(dtype: np.dtype) -> str:
    if dtype.kind in "OSU":
        return "STRING"
    if dtype.kind == "b":
        return "BOOL"
    return f"{_KIND_NAMES.get(dtype.kind, dtype.kind)}{dtype.itemsize * 8}"


# ---- pb_utils glue ---------------------------------------------------------------------------------

def request_arrays(request) -> dict[str, np.ndarray]:
    """The inputs of a `pb_utils.InferenceRequest` by name (CPU numpy views)."""
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def response_arrays(pb, response, model: str) -> dict[str, np.ndarray]:
    """Outputs of a BLS response by name (copied: the response's memory may be reused);
    RemoteError if the callee answered with an error."""
    if response.has_error():
        error = response.error()
        code = error.code() if hasattr(error, "code") else None
        raise RemoteError(model, error.message(), code)
    return {tensor.name(): np.array(tensor.as_numpy(), copy=True) for tensor in response.output_tensors()}


def output_tensors(pb, outputs: Mapping[str, np.ndarray]) -> list:
    return [pb.Tensor(name, np.ascontiguousarray(array)) for name, array in outputs.items()]


def string_array(values: list[str] | str, batched: bool = False) -> np.ndarray:
    """A STRING tensor: [n] (or [1, n] when `batched`) of UTF-8 bytes objects."""
    if isinstance(values, str):
        values = [values]
    array = np.array([v.encode("utf-8") for v in values], dtype=object)
    return array[None] if batched else array


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
