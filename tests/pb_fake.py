"""A stand-in for `triton_python_backend_utils`, to unit-test a `model.py` without Triton.

Only what our models use, with the real behaviour where it matters to a test: a response sender that
refuses to send after the final flag and records everything it sent; cancellation that a test can
trigger; metric families whose metrics a test can read; BLS through a handler the test supplies.

```
with pb_fake.installed() as pb:                       # sys.modules["triton_python_backend_utils"]
    module = pb_fake.load_model("model_repository/llm/1/model.py")
    model = module.TritonPythonModel()
    config = pb_fake.pbtxt_to_dict(render_template(template_text, values))
    model.initialize(pb_fake.initialize_args(config))
    request = pb.InferenceRequest(inputs=[pb.Tensor("text", np.array([b"hi"], dtype=object))])
    model.execute([request])
    responses = request.sender.wait_final(timeout=10)
```
"""
from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

MODULE_NAME = "triton_python_backend_utils"
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

_log = logging.getLogger("triton_python_backend_utils.fake")

TRITON_STRING_TO_NUMPY = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


class TritonModelException(Exception):
    pass


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL):
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        if not isinstance(array, np.ndarray):
            raise TritonModelException(f"Tensor {name}: expected a numpy array, got {type(array).__name__}")
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self):
        import torch.utils.dlpack

        return torch.utils.dlpack.to_dlpack(torch.from_numpy(self._array))

    @classmethod
    def from_dlpack(cls, name: str, obj) -> "Tensor":
        """From a DLPack capsule or an object with `__dlpack__` (a torch tensor)."""
        import torch.utils.dlpack

        return cls(name, torch.utils.dlpack.from_dlpack(obj).cpu().numpy())


class InferenceResponse:
    def __init__(self, output_tensors: Sequence[Tensor] = (), error: TritonError | None = None, parameters=None):
        self._outputs = list(output_tensors)
        self._error = error
        self._parameters = parameters

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def outputs(self) -> dict[str, np.ndarray]:
        """Fake only: the outputs by name."""
        return {t.name(): t.as_numpy() for t in self._outputs}


class InferenceResponseSender:
    """Records `(response, flags)`; `wait_final` blocks until the final flag has been sent."""

    def __init__(self, request: "InferenceRequest"):
        self._request = request
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self._final = threading.Event()
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self._lock:
            if self._final.is_set():
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            if response is None and flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                raise TritonModelException("a response without the final flag must not be None")
            self.sent.append((response, flags))
            if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self._final.set()

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()

    @property
    def finished(self) -> bool:
        return self._final.is_set()

    def wait_final(self, timeout: float = 30.0) -> list[InferenceResponse]:
        """The responses sent (None entries dropped) once the final flag is in; TimeoutError if not."""
        if not self._final.wait(timeout):
            raise TimeoutError(f"no final flag for request {self._request.request_id()!r} in {timeout} s")
        return [r for r, _ in self.sent if r is not None]


_ids = itertools.count()
_bls_handler: Callable | None = None


def set_bls_handler(handler: Callable | None) -> None:
    """`handler(request, decoupled) -> InferenceResponse | iterable of them` serves `request.exec()`."""
    global _bls_handler
    _bls_handler = handler


class InferenceRequest:
    def __init__(self, model_name: str = "", inputs: Sequence[Tensor] = (),
                 requested_output_names: Sequence[str] = (), request_id: str | None = None,
                 correlation_id: int = 0, parameters: dict | str | None = None, **_ignored):
        self._model_name = model_name
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self._id = f"fake-{next(_ids)}" if request_id is None else request_id
        self._correlation_id = correlation_id
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        self._cancelled = threading.Event()
        self.sender = InferenceResponseSender(self)

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int:
        return self._correlation_id

    def requested_output_names(self) -> list[str]:
        return self._requested

    def parameters(self) -> str:
        return self._parameters

    def model_name(self) -> str:
        return self._model_name

    def get_response_sender(self) -> InferenceResponseSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Fake only: what a client going away does."""
        self._cancelled.set()

    def exec(self, decoupled: bool = False):
        if _bls_handler is None:
            raise TritonModelException("BLS call without a handler (pb_fake.set_bls_handler)")
        result = _bls_handler(self, decoupled)
        return iter(result) if decoupled else result

    async def async_exec(self, decoupled: bool = False):
        return self.exec(decoupled)


class Logger:
    @staticmethod
    def log_info(message: str) -> None:
        _log.info(message)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning(message)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error(message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug(message)


class Metric:
    """Like the real one, a metric does not keep its family alive: keep the family referenced."""

    def __init__(self, family: "MetricFamily", labels: dict[str, str], buckets: Sequence[float] | None):
        self._family = weakref.ref(family)
        self.name = family.name
        self.kind = family.kind
        self.labels = dict(labels)
        self.buckets = list(buckets) if buckets is not None else None
        self._value = 0.0
        self.observations: list[float] = []

    def _check(self, *kinds: int) -> None:
        if self._family() is None:
            raise TritonModelException(f"{self.name}: invalid metric operation, its MetricFamily has been deleted")
        if self.kind not in kinds:
            raise TritonModelException(f"{self.name}: operation not allowed for this metric kind")

    def increment(self, value: float) -> None:
        self._check(MetricFamily.COUNTER, MetricFamily.GAUGE)
        if self.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException(f"{self.name}: a counter cannot decrease")
        self._value += value

    def set(self, value: float) -> None:
        self._check(MetricFamily.GAUGE)
        self._value = value

    def observe(self, value: float) -> None:
        self._check(MetricFamily.HISTOGRAM)
        self.observations.append(value)

    def value(self) -> float:
        self._check(MetricFamily.COUNTER, MetricFamily.GAUGE)
        return self._value


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
    # fake only: the live families by name (weak, so a family that the model drops disappears)
    registry: "weakref.WeakValueDictionary[str, MetricFamily]" = weakref.WeakValueDictionary()

    def __init__(self, name: str, description: str, kind: int):
        self.name = name
        self.description = description
        self.kind = kind
        self.metrics: list[Metric] = []
        MetricFamily.registry[name] = self

    def Metric(self, labels: dict[str, str] | None = None, buckets: Sequence[float] | None = None) -> Metric:  # noqa: N802
        if (self.kind == MetricFamily.HISTOGRAM) != (buckets is not None):
            raise TritonModelException(f"{self.name}: buckets are required for histograms and only for them")
        metric = Metric(self, labels or {}, buckets)
        self.metrics.append(metric)
        return metric


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((c for c in model_config.get("input", []) if c["name"] == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((c for c in model_config.get("output", []) if c["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def triton_string_to_numpy(triton_type: str):
    return TRITON_STRING_TO_NUMPY[triton_type]


# -- installing and loading ------------------------------------------------------------------------

@contextlib.contextmanager
def installed() -> Iterator[ModuleType]:
    """This module as `triton_python_backend_utils` for the duration of the block. The llm and token2wav
    models set torch's thread count, as in their own stub processes; the test process gets its own back."""
    import torch

    previous = sys.modules.get(MODULE_NAME)
    sys.modules[MODULE_NAME] = sys.modules[__name__]
    MetricFamily.registry.clear()
    set_bls_handler(None)
    threads = torch.get_num_threads()
    try:
        yield sys.modules[__name__]
    finally:
        torch.set_num_threads(threads)
        if previous is None:
            sys.modules.pop(MODULE_NAME, None)
        else:
            sys.modules[MODULE_NAME] = previous


def load_model(model_py: str | Path) -> ModuleType:
    """Import a `model.py` under a unique module name (use inside `installed()`)."""
    path = Path(model_py).resolve()
    name = f"_pb_fake_model_{next(_ids)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module


def initialize_args(model_config: dict, *, model_name: str | None = None, instance: int = 0,
                    repository: str | Path = "", version: int = 1) -> dict[str, str]:
    """The `args` that Triton passes to `initialize()`, for a model config given as a JSON-like dict."""
    name = model_name or model_config.get("name", "model")
    return {
        "model_config": json.dumps(model_config), "model_instance_kind": "CPU",
        "model_instance_name": f"{name}_{instance}_0", "model_instance_device_id": "0",
        "model_repository": str(repository), "model_version": str(version), "model_name": name,
    }


def pbtxt_to_dict(text: str) -> dict:
    """A `config.pbtxt` (already rendered) as the JSON dict that Triton gives `initialize()`."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    try:  # protobuf >= 5.26
        return json_format.MessageToDict(config, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
    except TypeError:
        return json_format.MessageToDict(config, preserving_proto_field_name=True,
                                         including_default_value_fields=True)
