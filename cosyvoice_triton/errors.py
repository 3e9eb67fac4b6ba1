"""Every error the library, the gateway and the SDKs raise, as data: one type per kind, each with a machine
`code`, the request `field` at fault (or None) and a retry hint `retry_after_s` (seconds, or None); the message
stays prose for people and is never parsed. Define a new kind here, never elsewhere.

Across Triton an error travels as `to_wire()`, a small JSON object that a model puts into
`TritonError(message, code)`:

    {"code": "invalid_input", "field": "seed", "message": "seed: must be an integer", "retry_after_s": null}

and `from_wire(message, status)` is the one reader of it (gateway, client SDKs, remote token2wav). A
message that is not ours (Triton's own "Request for unknown model ...", a gRPC status text) becomes the
kind its `status` names: a gRPC status name ("INVALID_ARGUMENT", "UNAVAILABLE", ...) or a Triton error
code name ("INVALID_ARG", ...); anything else is internal. The gateway answers each code with one HTTP
status (gateway/errors.py `HTTP_STATUS`).

    code                class               Triton code   gRPC status (non-JSON)
    invalid_input       InvalidInput        INVALID_ARG   INVALID_ARGUMENT, INVALID_ARG
    not_found           NotFound            NOT_FOUND     NOT_FOUND
    cancelled           Cancelled           CANCELLED     CANCELLED
    unavailable         Unavailable         UNAVAILABLE   RESOURCE_EXHAUSTED  (busy: a retry hint may say when)
    unreachable         Unreachable         UNAVAILABLE   UNAVAILABLE         (the server did not answer)
    timeout             DeadlineExceeded    UNAVAILABLE   DEADLINE_EXCEEDED
    model_folder        ModelFolderError    INTERNAL      -
    internal            CosyVoiceError      INTERNAL      anything else
    (the callee's)      RemoteError         (the callee's): a server or model we called answered with an error
  startup: engine_unavailable (EngineUnavailable), device_unavailable (DeviceUnavailable), parameter
  (ParameterError), and internal ones of serving and fine-tuning (TritonNotFound, TritonStartError, PortInUse, ...);
  the gateway's own answers: unauthorized, forbidden, too_large, too_many_streams,
  rate_limited, idle_timeout / session_timeout (SessionTimeout), overloaded, already_registered, upstream_error.
"""
from __future__ import annotations

import json


class CosyVoiceError(Exception):
    """Base class of the library's own errors; on its own, an internal error."""

    code = "internal"
    triton_code = "INTERNAL"  # the pb_utils.TritonError attribute a Triton model answers with
    field: str | None = None
    retry_after_s: int | None = None

    def __init__(self, *args, field: str | None = None, retry_after_s: int | None = None):
        super().__init__(*args)
        if field is not None:
            self.field = field
        if retry_after_s is not None:
            self.retry_after_s = max(1, int(retry_after_s))

    @property
    def message(self) -> str:
        return str(self) or self.code

    def to_wire(self) -> str:
        """The text of a TritonError: this error as a JSON object (see the module docstring)."""
        return json.dumps({"code": self.code, "field": self.field, "message": self.message,
                           "retry_after_s": self.retry_after_s}, ensure_ascii=False)

    @classmethod
    def _rebuild(cls, message: str, field: str | None, retry_after_s: int | None) -> CosyVoiceError:
        """This kind made from its wire parts, without the subclass's own constructor."""
        error = cls.__new__(cls)
        CosyVoiceError.__init__(error, message, field=field, retry_after_s=retry_after_s)
        return error


class _FieldError(CosyVoiceError):
    """An error about one request field: "field: problem"."""

    def __init__(self, field: str, problem: str):
        self.problem = problem
        super().__init__(f"{field}: {problem}", field=field)

    @classmethod
    def _rebuild(cls, message: str, field: str | None, retry_after_s: int | None) -> CosyVoiceError:
        error = super()._rebuild(message, field, retry_after_s)
        prefix = f"{field}: "
        error.problem = message[len(prefix):] if field and message.startswith(prefix) else message
        return error


class InvalidInput(_FieldError, ValueError):
    """A request field is missing, malformed or out of range. Maps to INVALID_ARG / HTTP 400."""

    code, triton_code = "invalid_input", "INVALID_ARG"


class NotFound(_FieldError, KeyError):
    """A referenced object (a voice id, a stream id) does not exist. Maps to NOT_FOUND / HTTP 404."""

    code, triton_code = "not_found", "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelFolderError(CosyVoiceError, FileNotFoundError):
    """The model folder is missing files or cannot be read."""

    code = "model_folder"


class Cancelled(CosyVoiceError):
    """The client went away or cancelled the request. Maps to CANCELLED / HTTP 499."""

    code, triton_code = "cancelled", "CANCELLED"


class Unavailable(CosyVoiceError):
    """The server cannot take the request now (queue full, shutting down). Maps to UNAVAILABLE / HTTP 503.
    `retry_after_s`: when the server expects to have room (admission refusals say it)."""

    code, triton_code = "unavailable", "UNAVAILABLE"


class Unreachable(Unavailable):
    """The server did not answer (connection refused or reset): another server may."""

    code = "unreachable"


class DeadlineExceeded(CosyVoiceError):
    """The server did not answer in time. Maps to HTTP 504."""

    code, triton_code = "timeout", "UNAVAILABLE"


class RemoteError(CosyVoiceError):
    """An error a server or model we called answered with (BLS, gRPC, the gateway's Triton calls), as the
    callee's kind: `error` is the callee's error (what `from_wire` read); its code, field, retry hint and Triton
    code are this error's. `model`: whom we called; `status`: the answer as it came (a Triton error code, a gRPC
    error), for a caller that passes it on unchanged."""

    def __init__(self, error: CosyVoiceError, model: str = "", status: object = None):
        super().__init__(error.message, field=error.field, retry_after_s=error.retry_after_s)
        self.error, self.model, self.status = error, model, status
        self.code, self.triton_code = error.code, error.triton_code

    @property
    def problem(self) -> str:
        """The message without its "field: " (an InvalidInput's or NotFound's problem)."""
        return getattr(self.error, "problem", self.error.message)

    @property
    def retryable(self) -> bool:
        """Another server may succeed: the callee was busy, did not answer, or not in time."""
        return isinstance(self.error, (Unavailable, DeadlineExceeded))


# ---- what a process finds wrong with its own setup, at start ---------------------------------------------

class EngineUnavailable(CosyVoiceError, RuntimeError):
    """An engine cannot run here (package or device missing); the message says what is missing."""

    code = "engine_unavailable"


class DeviceUnavailable(CosyVoiceError, RuntimeError):
    """A torch device that cannot be used here; the message says what is missing."""

    code = "device_unavailable"


class ParameterError(CosyVoiceError, ValueError):
    """A setting is not valid: a model's config.pbtxt parameters, a command-line option or a service's settings."""

    code = "parameter"


# ---- what serving or fine-tuning finds wrong before it can start (code: internal) -------------------------

class RedisNotFound(CosyVoiceError, RuntimeError):
    """No redis-server executable."""


class TritonNotFound(CosyVoiceError, FileNotFoundError):
    """No usable `tritonserver` executable, or its Python backend cannot serve this Python."""


class TritonStartError(CosyVoiceError, RuntimeError):
    """tritonserver exited or did not become ready in time. The message ends with the log's tail."""


class PortInUse(CosyVoiceError):
    """A port a server was told to listen on is taken."""


class TemplateError(CosyVoiceError, ValueError):
    """A template and its values do not match, or a repository cannot be rendered."""


class FinetuneError(CosyVoiceError):
    """Options that cannot work together, or a checkpoint that does not fit them."""


class DataError(CosyVoiceError):
    """The data folder cannot be used at all (no manifest, or no usable recording)."""


# ---- the gateway's own answers ---------------------------------------------------------------------------

class Unauthorized(CosyVoiceError):
    """No valid API key. Maps to HTTP 401."""

    code = "unauthorized"

    def __init__(self, message: str = "a valid API key is required (Authorization: Bearer KEY or X-API-Key)"):
        super().__init__(message)


class Forbidden(_FieldError):
    """The caller may see the object but not change it (a shared voice without an admin key). Never used for
    another tenant's voices: those are NotFound, as if they did not exist. Maps to HTTP 403."""

    code = "forbidden"


class AlreadyRegistered(_FieldError):
    """The recording and transcript are stored already (`existing`), and another id was asked for. HTTP 409."""

    code = "already_registered"

    def __init__(self, field: str, problem: str, existing: object = None):
        super().__init__(field, problem)
        self.existing = existing


class TooLarge(CosyVoiceError):
    """A body, an upload or a session's text is over its limit. Maps to HTTP 413."""

    code = "too_large"


class TooManyStreams(CosyVoiceError):
    """The caller holds as many streams as it may. Maps to HTTP 429 (retry in 1 s)."""

    code = "too_many_streams"

    def __init__(self, message: str):
        super().__init__(message, retry_after_s=1)


class RateLimited(CosyVoiceError):
    """The caller's key sent more requests than its rate allows. Maps to HTTP 429 with the seconds to wait."""

    code = "rate_limited"


class SessionTimeout(CosyVoiceError):
    """A WebSocket session closed for a time limit: `idle_timeout` (no client message and nothing in flight) or
    `session_timeout` (its whole length). Maps to HTTP 408."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Overloaded(Unavailable):
    """Admission refused the request: it would not start within the queue-wait limit, here or on the server
    (cosyvoice_triton/admission.py). Its retry hint says when the queue should have room."""

    code = "overloaded"


class Draining(Unavailable):
    """A new request (or a new synthesis in an open session) while the service drains before it stops."""


class UpstreamError(CosyVoiceError):
    """A server we called failed in a way no request field explains. Maps to HTTP 502."""

    code = "upstream_error"


KINDS: dict[str, type[CosyVoiceError]] = {kind.code: kind for kind in (
    CosyVoiceError, InvalidInput, NotFound, ModelFolderError, Cancelled, Unavailable, Unreachable,
    DeadlineExceeded, EngineUnavailable, DeviceUnavailable, ParameterError, Unauthorized, Forbidden,
    AlreadyRegistered, TooLarge, TooManyStreams, RateLimited, Overloaded, UpstreamError)}

# The kind of a message that is not ours, by the status it came with: gRPC status names and
# Triton error code names (pb_utils.TritonError / TRITONSERVER_Error_Code).
STATUS_KINDS: dict[str, str] = {
    "INVALID_ARGUMENT": "invalid_input", "INVALID_ARG": "invalid_input",
    "NOT_FOUND": "not_found",
    "CANCELLED": "cancelled",
    "RESOURCE_EXHAUSTED": "unavailable",
    "UNAVAILABLE": "unreachable",
    "DEADLINE_EXCEEDED": "timeout",
}


def from_wire(message: str, status: str | None = None) -> CosyVoiceError:
    """The error that a TritonError's text (or a gRPC status's details) stands for; see the module docstring."""
    text = (message or "").strip()
    fields = _wire_fields(text)
    if fields is None:
        kind = KINDS[STATUS_KINDS.get((status or "").upper(), "internal")]
        return kind._rebuild(text or status or "unknown error", None, None)
    kind = KINDS.get(fields.get("code"), CosyVoiceError)
    field, retry_after_s = fields.get("field"), fields.get("retry_after_s")
    return kind._rebuild(str(fields.get("message") or kind.code),
                         field if isinstance(field, str) and field else None,
                         retry_after_s if _is_seconds(retry_after_s) else None)


def _wire_fields(text: str) -> dict | None:
    """The JSON object of `to_wire` in `text` (Triton may put words before it), or None."""
    start = text.find("{")
    if start < 0 or not text.endswith("}"):
        return None
    try:
        fields = json.loads(text[start:])
    except ValueError:
        return None
    return fields if isinstance(fields, dict) and isinstance(fields.get("code"), str) else None


def _is_seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
