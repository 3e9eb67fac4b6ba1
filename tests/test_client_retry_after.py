"""`TTSError.retry_after_s`: the server's retry hint in every form a refusal carries it (no server here;
the real refusals are asserted in tests/test_load.py and tests/test_limits.py):

- Triton: a refusal under overload is an Unavailable error whose `retry_after_s` crosses as data in the
  error's JSON (cosyvoice_triton.admission.refusal, errors.from_wire), over a gRPC status (UNAVAILABLE)
  or a stream's error response;
- the gateway over HTTP: the `Retry-After` header, in delta-seconds or as an HTTP date;
- the gateway over the WebSocket: the error message's `retry_after`.
"""
from __future__ import annotations

import time
from email.utils import format_datetime
from datetime import datetime, timezone

import grpc
import pytest

from cosyvoice_triton.admission import Decision, expiry, refusal
from cosyvoice_triton.client import TTSError
from cosyvoice_triton.client.common import retry_after_seconds
from cosyvoice_triton.client.gateway_streams import error_from_body
from cosyvoice_triton.client.triton_client import _rpc_error
from cosyvoice_triton.errors import InvalidInput, from_wire

OVERLOADED = {"error": {"message": "every server is busy; retry after 3 s", "type": "server_error",
                        "code": "overloaded", "param": None}}


def test_a_triton_refusal_gives_its_seconds():
    refused = refusal("cosyvoice2", Decision(False, 4.2, 3), max_wait_s=1.0)
    error = TTSError.from_error(from_wire(refused.to_wire()))
    assert error.retry_after_s == 3 and error.message == refused.message and error.code == "unavailable"
    assert TTSError.from_error(from_wire(expiry("cosyvoice2", 2.5).to_wire())).retry_after_s == 1


def test_a_triton_error_without_a_hint_has_none():
    wire = InvalidInput("text", "must not be empty").to_wire()
    error = TTSError.from_error(from_wire(wire, "INVALID_ARGUMENT"), status="INVALID_ARGUMENT")
    assert error.retry_after_s is None and error.field == "text" and error.status == "INVALID_ARGUMENT"


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_grpc_unavailable_status_gives_the_seconds_of_its_error():
    refused = refusal("cosyvoice2", Decision(False, 9.0, 7), max_wait_s=2.0)
    error = _rpc_error(_RpcError(grpc.StatusCode.UNAVAILABLE, refused.to_wire()))
    assert (error.status, error.retry_after_s, error.code) == ("UNAVAILABLE", 7, "unavailable")
    unreachable = _rpc_error(_RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"))
    assert (unreachable.status, unreachable.retry_after_s, unreachable.code) == ("UNAVAILABLE", None, "unreachable")


@pytest.mark.parametrize("header, seconds", [("2", 2.0), (" 15 ", 15.0), (None, None), ("soon", None),
                                             ("-3", None), ("", None)])
def test_the_retry_after_header_in_seconds(header, seconds):
    error = error_from_body(b'{"error": {"message": "busy", "code": "overloaded"}}', 503, header)
    assert error.retry_after_s == seconds and error.status == 503 and error.code == "overloaded"


def test_the_retry_after_header_as_an_http_date():
    later = format_datetime(datetime.fromtimestamp(time.time() + 120, timezone.utc), usegmt=True)
    assert 100 < TTSError.from_body(OVERLOADED, 503, later).retry_after_s <= 120
    assert retry_after_seconds("Sun, 06 Nov 1994 08:49:37 GMT") == 0.0  # past: at once
    assert retry_after_seconds("Sun, 06 Nov 1994 08:49:37") is None  # no zone: not an HTTP date


def test_a_plain_text_answer_keeps_its_header_hint():
    error = error_from_body(b"<html>503 Service Unavailable</html>", 503, "4")
    assert error.retry_after_s == 4.0 and error.status == 503


def test_the_websocket_error_message_gives_retry_after():
    message = {"type": "error", "status": 503, "code": "overloaded", "param": None,
               "message": "every server is busy; retry after 2 s", "retry_after": 2}
    error = TTSError.from_body(message)
    assert (error.status, error.code, error.retry_after_s) == (503, "overloaded", 2.0)
    without = TTSError.from_body({"type": "error", "status": 400, "code": "invalid_input", "param": "text",
                                  "message": "text: must not be empty"})
    assert without.retry_after_s is None and without.field == "text"
