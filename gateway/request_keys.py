"""Keys of per-request values (`request[KEY]`), set by the middlewares."""
from __future__ import annotations

from aiohttp import web


def _request_key(name: str, kind: type):
    """A `web.RequestKey` (aiohttp 3.12+), else the plain name."""
    return web.RequestKey(name, kind) if hasattr(web, "RequestKey") else name


API_KEY = _request_key("api_key", str)  # the API key a request authenticated with
TENANT = _request_key("tenant", object)  # its auth.Tenant (every non-public request, keyless ones too)
ERROR_CODE = _request_key("error_code", str)  # the code of the error a request was answered with
ABORTED = _request_key("aborted", bool)  # a streamed response was cut after its headers went out
