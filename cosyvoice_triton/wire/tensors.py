"""Typed reading of one request's tensors, and STRING tensors; torch-free and without `pb_utils`.

`TensorReader` reads the inputs of one request (a name -> numpy array mapping, so it is testable without
Triton) into Python values, and every problem it finds is an `InvalidInput` naming the input. For a model with
`max_batch_size > 0` each request carries a leading batch dimension of 1, which `batched=True` strips.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cosyvoice_triton.errors import InvalidInput

_KIND_NAMES = {"b": "BOOL", "i": "INT", "u": "UINT", "f": "FP", "O": "STRING", "S": "STRING", "U": "STRING"}


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


def string_array(values: list[str] | str, batched: bool = False) -> np.ndarray:
    """A STRING tensor: [n] (or [1, n] when `batched`) of UTF-8 bytes objects."""
    if isinstance(values, str):
        values = [values]
    array = np.array([v.encode("utf-8") for v in values], dtype=object)
    return array[None] if batched else array
