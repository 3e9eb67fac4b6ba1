"""One access-log line per request (docs/operations/tenants.md#access-log), on by default (`--no-access-log`): the
routes report audio with `first_chunk`, `first_audible` and `audio_sent`; the reporting middleware opens the record
(`begin`) and writes the line (`write`) when the handler ends. Never logs a query string, a header or a body.
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
