"""Keys of per-request values (`request[KEY]`), set by the middlewares, and how a request ended."""
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
ABORTED = _request_key("aborted", bool)  # a streamed response was cut after its headers went out
CLIENT_LEFT = _request_key("client_left", bool)  # a WebSocket client closed or cut its session mid-stream


async def handle_and_report(request: web.Request, handler, report: Callable[[str, str], None]) -> web.StreamResponse:
    """`handler(request)`, then `report(route, status)` however it ended. route: the route as registered
    ("unmatched" for none); status: the HTTP status, "aborted" (a stream cut after its headers went out),
    "cancelled" (the client went away, or a WebSocket client left mid-session) or "500" (any other
    exception)."""
    status = "500"
    try:
        response = await handler(request)
        status = ("cancelled" if request.get(CLIENT_LEFT) else "aborted" if request.get(ABORTED)
                  else str(response.status))
        return response
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    except web.HTTPException as exc:
        status = str(exc.status)
        raise
    finally:
        resource = request.match_info.route.resource
        report(resource.canonical if resource is not None else "unmatched", status)
