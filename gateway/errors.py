"""How every error becomes the gateway's answer: one HTTP status per error code (`HTTP_STATUS`, the one table),
a JSON body or a WebSocket error message. The errors themselves are the library's kinds (cosyvoice_triton/errors.py);
this module defines none. A Triton server's error becomes the answer in `upstream`, once.

Body (the OpenAI error object, so OpenAI clients read it too; `param` names the request field):
  {"error": {"message": "text: must not be empty", "type": "invalid_request_error",
             "code": "invalid_input", "param": "text"}}
Every message is cut to MAX_MESSAGE_CHARS here as a last bound; JSON nested deeper than Python can parse is a
400 naming `body`, never a 500.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from cosyvoice_triton.errors import (Cancelled, CosyVoiceError, DeadlineExceeded, InvalidInput, NotFound, Overloaded,
                                     TooLarge, Unavailable, Unreachable, UpstreamError)

from .request_keys import ERROR_CODE

if TYPE_CHECKING:
    from .fields import Fields

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 400
MAX_FIELD_CHARS = 64
INTERNAL = (500, "server_error")
# Error code -> (HTTP status, the OpenAI error `type`); a code not here is an internal error (500).
HTTP_STATUS: dict[str, tuple[int, str]] = {
    "invalid_input": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "forbidden": (403, "permission_error"),
    "not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "idle_timeout": (408, "invalid_request_error"),
    "session_timeout": (408, "invalid_request_error"),
    "already_registered": (409, "invalid_request_error"),
    "too_large": (413, "invalid_request_error"),
    "too_many_streams": (429, "rate_limit_error"),
    "rate_limited": (429, "rate_limit_error"),
    "upstream_error": (502, "server_error"),
    "unavailable": (503, "server_error"),
    "overloaded": (503, "server_error"),
    "timeout": (504, "server_error"),
}
WWW_AUTHENTICATE = {"WWW-Authenticate": "Bearer"}  # with every 401


def http_status(error: CosyVoiceError) -> int:
    return HTTP_STATUS.get(error.code, INTERNAL)[0]


def retry_after_s(error: CosyVoiceError) -> int | None:
    """The seconds to wait that the answer says: the error's own hint, at least 1 s for a 503."""
    return error.retry_after_s or (1 if http_status(error) == 503 else None)


def answer_headers(error: CosyVoiceError) -> dict[str, str]:
    headers = dict(WWW_AUTHENTICATE) if error.code == "unauthorized" else {}
    if retry_after_s(error) is not None:
        headers["Retry-After"] = str(retry_after_s(error))
    return headers


def answer_of(exc: BaseException) -> CosyVoiceError:
    """Any exception raised in the gateway as the error it answers with: the library's kinds as they are (a
    server that did not answer, or a cancelled call: unavailable), everything else internal."""
    if isinstance(exc, (Unreachable, Cancelled)):
        return Unavailable(exc.message, retry_after_s=exc.retry_after_s)
    if isinstance(exc, CosyVoiceError) and exc.code in HTTP_STATUS:
        return exc
    if isinstance(exc, RecursionError):  # json.loads of deeply nested arrays
        return InvalidInput("body", "is nested too deeply")
    return CosyVoiceError("internal error")


def upstream(error: CosyVoiceError, fields: Fields, unnamed: str = "request") -> CosyVoiceError:
    """A Triton server's error (a model's, or its call's) as the gateway's answer, from its data alone: a field
    named by the called API's name (`fields`), a refusal as overloaded, a server that did not answer as
    unavailable; what no field explains (Triton's own unknown model too) as an upstream error."""
    if isinstance(error, InvalidInput) or error.code == "invalid_input":
        return InvalidInput(fields.of_input(error.field) or unnamed, getattr(error, "problem", error.message))
    if error.code == "not_found" and error.field is not None:
        return NotFound(fields.voice_id, getattr(error, "problem", error.message))
    if error.code == "unavailable":  # the server's admission (or a full queue) refused it
        return Overloaded(error.message, retry_after_s=error.retry_after_s or 1)
    if error.code in ("unreachable", "cancelled"):
        return Unavailable(error.message)
    if error.code == "timeout":
        return DeadlineExceeded(error.message)
    return UpstreamError(error.message)


def too_large_upload(what: str, size: int | None, limit: int, field: str | None = None) -> TooLarge:
    """`what` of `size` bytes over `limit`, said in MB with the flag that raises the limit."""
    got = f": {size / 2**20:.1f} MB" if size is not None else ""
    return TooLarge(f"{what}{got} is more than the limit of {limit / 2**20:.1f} MB (the gateway\x27s "
                    f"--max-upload-mb raises it)", field=field)


def bounded(text: str | None, limit: int = MAX_MESSAGE_CHARS) -> str | None:
    return text if text is None or len(text) <= limit else text[:limit] + "... (cut)"


def error_body(error: CosyVoiceError) -> dict:
    return {"error": {"message": bounded(error.message), "type": HTTP_STATUS.get(error.code, INTERNAL)[1],
                      "code": error.code, "param": bounded(error.field, MAX_FIELD_CHARS)}}


def ws_error(error: CosyVoiceError) -> dict:
    """The same error as a WebSocket message."""
    message = {"type": "error", "status": http_status(error), "code": error.code,
               "param": bounded(error.field, MAX_FIELD_CHARS), "message": bounded(error.message)}
    if retry_after_s(error) is not None:  # 429, 503: the seconds an HTTP answer would say in Retry-After
        message["retry_after"] = retry_after_s(error)
    return message


def json_error(error: CosyVoiceError, request: web.Request) -> web.Response:
    request[ERROR_CODE] = error.code
    return web.json_response(error_body(error), status=http_status(error), headers=answer_headers(error))


def http_exception_answer(exc: web.HTTPException, request: web.Request) -> web.Response:
    """aiohttp's own answer (no such route, a method the route does not take) as a JSON error."""
    request[ERROR_CODE] = code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
    message = exc.reason if not exc.text or exc.text.startswith(str(exc.status)) else exc.text
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return web.json_response({"error": {"message": bounded(message), "type": kind, "code": code, "param": None}},
                             status=exc.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except web.HTTPRequestEntityTooLarge:  # aiohttp's own limit on the body (app.body_limit)
        return json_error(too_large_upload("the request body", None, request.client_max_size), request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return http_exception_answer(exc, request)
    except Exception as exc:  # noqa: BLE001 - every other error becomes JSON
        error = answer_of(exc)
        if http_status(error) >= 500 and error is not exc:
            log.exception("%s %s failed", request.method, request.path)
        return json_error(error, request)
