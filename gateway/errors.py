"""The gateway's errors, and how every error becomes an HTTP status and a JSON body.

Body (the OpenAI error object, so OpenAI clients read it too; `param` names the request field):
  {"error": {"message": "text: must not be empty", "type": "invalid_request_error",
             "code": "invalid_input", "param": "text"}}
A message echoes at most a short, repr-escaped piece of the offending value (`short_repr` where it is
made; every message is cut to MAX_MESSAGE_CHARS here as a last bound). JSON nested deeper than Python
can parse is a 400 naming `body`, never a 500.

A GatewayError is one of the library's errors (`CosyVoiceError`): it carries its `code`, `field` and retry
hint `retry_after_s` as data, which the answer says as `code`, `param` and the Retry-After header (a
WebSocket error's `retry_after`); the client SDK reads them back from there (`TTSError.from_body`).
"""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from cosyvoice_triton.errors import Cancelled, CosyVoiceError, InvalidInput, NotFound, Unavailable

from .request_keys import ERROR_CODE

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 400


class GatewayError(CosyVoiceError):
    status = 500
    code = "internal"
    kind = "server_error"  # the OpenAI `type`

    def __init__(self, message: str, field: str | None = None, headers: dict[str, str] | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message, field=field, retry_after_s=retry_after_s)
        self.headers = dict(headers or {})
        if self.retry_after_s is not None:
            self.headers["Retry-After"] = str(self.retry_after_s)


class BadRequest(GatewayError):
    status, code, kind = 400, "invalid_input", "invalid_request_error"

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}", field)


class Unauthorized(GatewayError):
    status, code, kind = 401, "unauthorized", "authentication_error"

    def __init__(self, message: str = "a valid API key is required (Authorization: Bearer KEY or X-API-Key)"):
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class VoiceNotFound(GatewayError):
    status, code, kind = 404, "not_found", "invalid_request_error"

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}", field)


class Forbidden(GatewayError):
    """The caller may see the object but not change it (a shared voice without an admin key). Never
    used for another tenant's voices: those answer 404, as if they did not exist."""

    status, code, kind = 403, "forbidden", "permission_error"

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}", field)


class PayloadTooLarge(GatewayError):
    status, code, kind = 413, "too_large", "invalid_request_error"

    @classmethod
    def upload(cls, what: str, size: int | None, limit: int, field: str | None = None) -> "PayloadTooLarge":
        """`what` of `size` bytes over `limit`, said in MB with the flag that raises the limit."""
        got = f": {size / 2**20:.1f} MB" if size is not None else ""
        return cls(f"{what}{got} is more than the limit of {limit / 2**20:.1f} MB (the gateway\x27s "
                   f"--max-upload-mb raises it)", field)


class TooManyStreams(GatewayError):
    status, code, kind = 429, "too_many_streams", "rate_limit_error"

    def __init__(self, message: str):
        super().__init__(message, retry_after_s=1)


class RateLimited(GatewayError):
    status, code, kind = 429, "rate_limited", "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, retry_after_s=retry_after_s)


class SessionTimeout(GatewayError):
    """A WebSocket session closed for a time limit: `idle_timeout` (no client message and nothing in
    flight) or `session_timeout` (its whole length)."""

    status, kind = 408, "invalid_request_error"

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class ServiceUnavailable(GatewayError):
    status, code, kind = 503, "unavailable", "server_error"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, retry_after_s=retry_after_s)


class Overloaded(ServiceUnavailable):
    """Admission refused the request (cosyvoice_triton/admission.py): it would not start within the
    queue-wait limit, here or on the server. Retry-After says when the queue should have room."""

    code = "overloaded"


class UpstreamError(GatewayError):
    """Triton answered with an error the gateway cannot attribute to a request field."""

    status, code, kind = 502, "upstream_error", "server_error"


class UpstreamTimeout(GatewayError):
    status, code, kind = 504, "timeout", "server_error"


def as_gateway_error(exc: BaseException) -> GatewayError:
    """Any exception as a GatewayError (library errors keep their field and retry hint)."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, InvalidInput):
        return BadRequest(exc.field, exc.problem)
    if isinstance(exc, NotFound):
        return VoiceNotFound(exc.field, exc.problem)
    if isinstance(exc, Unavailable):
        return ServiceUnavailable(exc.message, exc.retry_after_s or 1)
    if isinstance(exc, Cancelled):
        return ServiceUnavailable(exc.message)
    if isinstance(exc, RecursionError):  # json.loads of deeply nested arrays
        return BadRequest("body", "is nested too deeply")
    if isinstance(exc, web.HTTPException):
        error = GatewayError(exc.reason if not exc.text or exc.text.startswith(str(exc.status)) else exc.text)
        error.status = exc.status
        error.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        error.kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return error
    return GatewayError("internal error")


MAX_FIELD_CHARS = 64


def bounded(text: str | None, limit: int = MAX_MESSAGE_CHARS) -> str | None:
    return text if text is None or len(text) <= limit else text[:limit] + "... (cut)"


def error_body(error: GatewayError) -> dict:
    return {"error": {"message": bounded(error.message), "type": error.kind, "code": error.code,
                      "param": bounded(error.field, MAX_FIELD_CHARS)}}


def ws_error(error: GatewayError) -> dict:
    """The same error as a WebSocket message."""
    message = {"type": "error", "status": error.status, "code": error.code,
               "param": bounded(error.field, MAX_FIELD_CHARS), "message": bounded(error.message)}
    if error.retry_after_s is not None:  # 429, 503: the seconds an HTTP answer would say in Retry-After
        message["retry_after"] = error.retry_after_s
    return message


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except web.HTTPRequestEntityTooLarge:  # aiohttp's own limit on the body (app.body_limit)
        return _json_error(PayloadTooLarge.upload("the request body", None, request.client_max_size), request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json_error(as_gateway_error(exc), request)
    except Exception as exc:  # noqa: BLE001 - every other error becomes JSON
        error = as_gateway_error(exc)
        if error.status >= 500 and not isinstance(exc, GatewayError):
            log.exception("%s %s failed", request.method, request.path)
        return _json_error(error, request)


def _json_error(error: GatewayError, request: web.Request) -> web.Response:
    request[ERROR_CODE] = error.code
    return web.json_response(error_body(error), status=error.status, headers=error.headers)
