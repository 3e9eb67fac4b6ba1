"""Keys of per-request values (`request[KEY]`), set by the middlewares, and how a request ended.

How a request ended is decided once, by `handle_and_report` (run by the one reporting middleware, app.py
`report_middleware`), and that one status is what both the requests counter and the access log record:
  "cancelled"  the client left: it closed or cut its connection before its answer was all sent, whether we
               noticed it as the handler's cancellation or as a write that failed on the closing connection
               (`client_left`), a WebSocket client included that closes or cuts its session mid-stream
  "aborted"    we cut a streamed answer after its headers because it failed (audio_response.abort)
  "500"        any other exception
  else         the HTTP status
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web


def _request_key(name: str, kind: type):
    """A `web.RequestKey` (aiohttp 3.12+), else the plain name."""
    return web.RequestKey(name, kind) if hasattr(web, "RequestKey") else name


API_KEY = _request_key("api_key", str)  # the API key a request authenticated with
TENANT = _request_key("tenant", object)  # its auth.Tenant (every non-public request, keyless ones too)
ERROR_CODE = _request_key("error_code", str)  # the code of the error a request was answered with
ABORTED = _request_key("aborted", bool)  # we cut a streamed response after its headers went out: it failed
CLIENT_LEFT = _request_key("client_left", bool)  # the client went away before its answer was all sent

CANCELLED, CUT = "cancelled", "aborted"  # the statuses of a request the client left, and of one we cut


def client_left(request: web.Request) -> None:
    """Note that the client of `request` went away (a write to it failed on the closing connection, or a
    WebSocket client closed or cut its session): the request ends "cancelled", never as an error of ours."""
    request[CLIENT_LEFT] = True


def ended_as(request: web.Request, response: web.StreamResponse) -> str:
    """The status of a request whose handler returned `response`."""
    if request.get(CLIENT_LEFT):
        return CANCELLED
    return CUT if request.get(ABORTED) else str(response.status)


async def handle_and_report(request: web.Request, handler, report: Callable[[str, str], None]) -> web.StreamResponse:
    """`handler(request)`, then `report(route, status)` once, however it ended. route: the route as registered
    ("unmatched" for none); status: as the module docstring says (the handler's cancellation: "cancelled")."""
    status = "500"
    try:
        response = await handler(request)
        status = ended_as(request, response)
        return response
    except asyncio.CancelledError:
        status = CANCELLED
        raise
    except web.HTTPException as exc:
        status = str(exc.status)
        raise
    finally:
        resource = request.match_info.route.resource
        report(resource.canonical if resource is not None else "unmatched", status)
