"""One access log line per request, on by default (`GatewayConfig.access_log`; `--no-access-log`):

    access POST /v1/audio/speech 200 first_chunk_ms=412 first_audible_ms=430 audio_s=2.36 total_ms=1630

method, the route as registered (`/v1/voices/{voice_id}`, never the query string: no keys, no ids from the
URL), the status (request_keys.py: "cancelled" when the client left, "aborted" when we cut a failed stream
after its headers; the same status the requests counter records, decided once per request),
the milliseconds from accepting the request to its first audio byte and to the chunk holding its first
audible sample (cosyvoice_triton/pipeline/audible.py; "-" when none was audible, or the route does not
tell), the seconds of audio sent ("-" for requests without audio), and the time the request took.
Nothing from headers or bodies is logged.

The routes report audio with `first_chunk(request, seconds)`, `first_audible(request, seconds)` and
`audio_sent(request, seconds)`; the
reporting middleware (app.py `report_middleware`) opens the record (`begin`) and writes the line (`write`)
when the handler ends (after the last byte of a streamed answer). The lines go
to the logger `cosyvoice_triton.gateway.access`, which gets its own stderr handler at INFO
(`enable_access_log`), so they show whatever level the rest of the logs have.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from aiohttp import web

from .request_keys import _request_key

ACCESS_LOGGER = "cosyvoice_triton.gateway.access"
log = logging.getLogger(ACCESS_LOGGER)


@dataclass
class AccessRecord:
    started: float  # time.monotonic() when the request came in
    first_chunk_s: float | None = None  # accepted -> first audio byte out
    first_audible_s: float | None = None  # accepted -> the chunk holding the first audible sample out
    audio_s: float = 0.0  # seconds of audio sent


ACCESS = _request_key("access", AccessRecord)


def first_chunk(request: web.Request, seconds: float) -> None:
    """The first audio byte of `request` went out `seconds` after it was accepted (the first call counts)."""
    record = request.get(ACCESS)
    if record is not None and record.first_chunk_s is None:
        record.first_chunk_s = seconds


def first_audible(request: web.Request, seconds: float) -> None:
    """The chunk holding the first audible sample of `request` went out `seconds` after it was accepted."""
    record = request.get(ACCESS)
    if record is not None and record.first_audible_s is None:
        record.first_audible_s = seconds


def audio_sent(request: web.Request, seconds: float) -> None:
    record = request.get(ACCESS)
    if record is not None:
        record.audio_s += seconds


def access_line(method: str, route: str, status: str, record: AccessRecord, now: float) -> str:
    first, audible = _ms(record.first_chunk_s), _ms(record.first_audible_s)
    audio = f"{record.audio_s:.2f}" if record.first_chunk_s is not None or record.audio_s else "-"
    return (f"access {method} {route} {status} first_chunk_ms={first} first_audible_ms={audible} audio_s={audio} "
            f"total_ms={(now - record.started) * 1000:.0f}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def begin(request: web.Request) -> None:
    """Open the access record of a request just accepted."""
    request[ACCESS] = AccessRecord(started=time.monotonic())


def write(request: web.Request, route: str, status: str) -> None:
    """The request's access line, with the status decided for it (request_keys.handle_and_report)."""
    record = request.get(ACCESS)
    if record is not None:
        log.info("%s", access_line(request.method, route, status, record, time.monotonic()))


def enable_access_log() -> None:
    """Give the access logger its own stderr handler at INFO, once per process."""
    if any(getattr(h, "_cosyvoice_access", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    handler._cosyvoice_access = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # not twice where the root logger has a handler too
