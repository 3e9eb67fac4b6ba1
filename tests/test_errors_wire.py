"""Errors are data (cosyvoice_triton/errors.py): each kind carries a code, the field and a retry hint across
Triton as JSON (`to_wire`), read back by one parser (`from_wire`); the gateway's HTTP answer and the client
SDK's TTSError are derived from that data alone, never from the prose (no Triton server here)."""
from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest

from cosyvoice_triton import messages
from cosyvoice_triton.admission import Decision, expiry, refusal
from cosyvoice_triton.client.common import TTSError
from cosyvoice_triton.errors import (
    KINDS,
    Cancelled,
    CosyVoiceError,
    DeadlineExceeded,
    InvalidInput,
    ModelFolderError,
    NotFound,
    Unavailable,
    Unreachable,
    from_wire,
)
from cosyvoice_triton.errors import RateLimited, TooManyStreams
from cosyvoice_triton.gateway.errors import answer_headers, answer_of, error_body, http_status, upstream, ws_error
from cosyvoice_triton.gateway.fields import OPENAI_FIELDS, TTS_FIELDS
from cosyvoice_triton.llm.scheduler import LLMStepError, SchedulerUnavailable
from cosyvoice_triton.triton.pb_glue import classify, remote_error, triton_error
from cosyvoice_triton.voices.store import CorruptVoice
import pb_fake

ROOT = Path(__file__).resolve().parents[1]

# One of each kind, with its code, field and retry hint.
EVERY_KIND = [
    (InvalidInput("seed", "must be an integer"), "invalid_input", "seed", None),
    (NotFound("reference_audio_id", "no voice 'x' is registered"), "not_found", "reference_audio_id", None),
    (Cancelled("the client went away"), "cancelled", None, None),
    (Unavailable("cosyvoice2 is busy", retry_after_s=4), "unavailable", None, 4),
    (Unavailable("the voice store is unreachable"), "unavailable", None, None),
    (Unreachable("the server did not answer"), "unreachable", None, None),
    (DeadlineExceeded("no answer within 5 s"), "timeout", None, None),
    (ModelFolderError("llm.pt is missing"), "model_folder", None, None),
    (CosyVoiceError("something broke"), "internal", None, None),
]


@pytest.mark.parametrize("error, code, field, retry_after_s", EVERY_KIND, ids=lambda v: getattr(v, "code", None))
def test_every_kind_round_trips_through_the_wire(error, code, field, retry_after_s):
    wire = error.to_wire()
    assert json.loads(wire) == {"code": code, "field": field, "message": error.message,
                                "retry_after_s": retry_after_s}
    read = from_wire(wire)
    assert type(read) is type(error) and type(read) is KINDS[code]
    assert (read.code, read.field, read.retry_after_s, read.message) == (code, field, retry_after_s, error.message)
    assert read.to_wire() == wire


def test_field_errors_keep_their_problem_and_their_exception_bases():
    read = from_wire(InvalidInput("top_p", "must be in (0, 1], got 2.0").to_wire())
    assert isinstance(read, ValueError) and read.problem == "must be in (0, 1], got 2.0"
    missing = from_wire(NotFound("stream_id", "no stream 't9'").to_wire())
    assert isinstance(missing, KeyError) and str(missing) == "stream_id: no stream 't9'"
    assert missing.problem == "no stream 't9'"


def test_subclasses_travel_as_their_kind():
    assert from_wire(SchedulerUnavailable("the LLM request queue is full (8 waiting)").to_wire()).code == "unavailable"
    assert type(from_wire(LLMStepError("a decode step failed").to_wire())) is CosyVoiceError
    assert from_wire(CorruptVoice("v1", "bad blob").to_wire()).code == "internal"
    assert from_wire(Cancelled().to_wire()).message == "cancelled"  # an empty message says its kind


def test_admission_refusals_carry_their_retry_hint_as_data():
    refused = refusal("cosyvoice2", Decision(False, 9.5, 8), max_wait_s=2.0)
    assert isinstance(refused, Unavailable) and refused.retry_after_s == 8
    assert from_wire(refused.to_wire()).retry_after_s == 8
    assert from_wire(expiry("cosyvoice2", 2.5).to_wire()).retry_after_s == 1


@pytest.mark.parametrize("status, kind", [
    ("INVALID_ARGUMENT", InvalidInput), ("INVALID_ARG", InvalidInput), ("NOT_FOUND", NotFound),
    ("CANCELLED", Cancelled), ("UNAVAILABLE", Unreachable), ("RESOURCE_EXHAUSTED", Unavailable),
    ("DEADLINE_EXCEEDED", DeadlineExceeded), ("INTERNAL", CosyVoiceError), ("UNKNOWN", CosyVoiceError),
    ("UNIMPLEMENTED", CosyVoiceError), (None, CosyVoiceError),
])
def test_a_message_that_is_not_ours_is_the_kind_its_status_names(status, kind):
    read = from_wire("Request for unknown model: 'nope' is not found", status)
    assert type(read) is kind
    assert (read.message, read.field, read.retry_after_s) == ("Request for unknown model: 'nope' is not found",
                                                              None, None)


@pytest.mark.parametrize("text", ["", "{", "{not json}", '{"message": "no code"}', "[1, 2]", '{"code": 3}'])
def test_malformed_wire_text_is_read_by_status(text):
    assert type(from_wire(text, "INVALID_ARGUMENT")) is InvalidInput
    assert type(from_wire(text)) is CosyVoiceError


def test_odd_wire_values_are_tolerated():
    assert type(from_wire('{"code": "from_the_future", "message": "new"}')) is CosyVoiceError
    read = from_wire('{"code": "unavailable", "field": "", "message": "full", "retry_after_s": "soon"}')
    assert (type(read), read.field, read.retry_after_s) == (Unavailable, None, None)
    assert from_wire('{"code": "unavailable", "message": "full", "retry_after_s": 0.2}').retry_after_s == 1
    # words that Triton may put before a model's error do not hide it
    assert from_wire("in ensemble 'x': " + InvalidInput("seed", "bad").to_wire()).field == "seed"


def test_non_ascii_messages_stay_readable_on_the_wire():
    error = InvalidInput("target_text", "got '你好'")
    assert "你好" in error.to_wire() and from_wire(error.to_wire()).message == error.message


# ---- the Triton side ---------------------------------------------------------------------------------

def test_triton_errors_carry_the_json_with_the_matching_code():
    with pb_fake.installed() as pb:
        for error, code, _, _ in EVERY_KIND:
            sent = triton_error(pb, error, "m")
            assert sent.message() == error.to_wire()
            assert sent.code() == getattr(pb.TritonError, error.triton_code)
        assert triton_error(pb, InvalidInput("seed", "bad"), "m").code() == pb.TritonError.INVALID_ARG
        assert triton_error(pb, Unavailable("full", retry_after_s=2), "m").code() == pb.TritonError.UNAVAILABLE


def test_an_unexpected_exception_is_logged_and_sent_short(caplog):
    try:
        {}["a secret key from deep inside"]
    except KeyError as exc:
        unexpected = exc
    with pb_fake.installed() as pb, caplog.at_level(logging.ERROR):
        sent = triton_error(pb, unexpected, "m")
    assert sent.code() == pb.TritonError.INTERNAL
    read = from_wire(sent.message())
    assert (read.code, read.message) == ("internal", "internal error (KeyError)")
    assert "a secret key" not in sent.message()
    assert "Traceback" in caplog.text and "a secret key" in caplog.text


def test_a_callee_error_keeps_its_kind():
    busy = remote_error("token2wav", Unavailable("token2wav is full", retry_after_s=2).to_wire(), 4)
    assert (busy.code, busy.retry_after_s, busy.status, type(busy.error)) == ("unavailable", 2, 4, Unavailable)
    assert classify(busy) == classify(busy.error)  # passed on as the callee said it
    bad = remote_error("llm", "stream_id: not a stream", "INVALID_ARG")  # Triton's own text: by its code
    assert (bad.code, classify(bad).code_name) == ("invalid_input", "INVALID_ARG")


# ---- the gateway and the client SDK: from the data, never the prose ------------------------------------

def _answer(error: CosyVoiceError, fields=TTS_FIELDS) -> tuple:
    """What the gateway answers for a model's error: status, code, param, Retry-After."""
    answer = upstream(from_wire(error.to_wire()), fields)
    body = error_body(answer)["error"]
    return http_status(answer), body["code"], body["param"], answer_headers(answer).get("Retry-After")


REWORDED = [
    (InvalidInput("seed", "must be an integer"), InvalidInput("seed", "is not a whole number, is it?"),
     (400, "invalid_input", "seed", None)),
    (InvalidInput("target_text", "must not be empty"), InvalidInput("target_text", "busy: retry after 9 s"),
     (400, "invalid_input", "text", None)),
    (NotFound("reference_audio_id", "no voice 'x' is registered"), NotFound("reference_audio_id", "unknown"),
     (404, "not_found", "voice_id", None)),
    (Unavailable("cosyvoice2 is busy; retry after 3 s", retry_after_s=3),
     Unavailable("please come back later (in 1 s)", retry_after_s=3), (503, "overloaded", None, "3")),
    (Unavailable("the LLM request queue is full"), Unavailable("no room"), (503, "overloaded", None, "1")),
    (Unreachable("failed to connect"), Unreachable("busy busy busy"), (503, "unavailable", None, "1")),
    (DeadlineExceeded("no first chunk within 5 s"), DeadlineExceeded("slow"), (504, "timeout", None, None)),
    (CosyVoiceError("internal error (KeyError)"), CosyVoiceError("seed: busy; retry after 5 s"),
     (502, "upstream_error", None, None)),
]


@pytest.mark.parametrize("first, reworded, answer", REWORDED, ids=lambda v: getattr(v, "code", None))
def test_rewording_a_message_does_not_change_the_http_answer(first, reworded, answer):
    assert _answer(first) == _answer(reworded) == answer


def test_the_field_maps_to_each_apis_own_name():
    assert _answer(InvalidInput("target_text", "too long"), OPENAI_FIELDS)[2] == "input"
    assert _answer(InvalidInput("some_new_input", "bad"))[2] == "some_new_input"


def test_a_triton_not_found_without_a_field_is_the_deployments_fault():
    unknown_model = from_wire("Request for unknown model: 'cosyvoice2' is not found", "NOT_FOUND")
    assert unknown_model.field is None and http_status(upstream(unknown_model, TTS_FIELDS)) == 502


@pytest.mark.parametrize("error", [e for e, *_ in EVERY_KIND], ids=lambda e: e.code)
def test_the_client_sdk_reads_the_same_data(error):
    sdk = TTSError.from_error(from_wire(error.to_wire()), status="UNAVAILABLE")
    assert (sdk.code, sdk.field, sdk.retry_after_s, sdk.message) == (
        error.code, error.field, error.retry_after_s, error.message)


def test_gateway_errors_carry_their_retry_hint_as_data():
    for error, seconds in ((Unavailable("draining", retry_after_s=3), 3),
                           (RateLimited("too many", retry_after_s=7), 7), (TooManyStreams("two at most"), 1)):
        assert isinstance(error, CosyVoiceError) and error.retry_after_s == seconds
        assert answer_headers(error)["Retry-After"] == str(seconds) and ws_error(error)["retry_after"] == seconds
        sdk = TTSError.from_body(error_body(error), http_status(error), answer_headers(error)["Retry-After"])
        assert (sdk.code, sdk.retry_after_s) == (error.code, seconds)
    bad = InvalidInput("text", "must not be empty")
    assert (bad.code, bad.field, bad.retry_after_s, "Retry-After" in answer_headers(bad)) == (
        "invalid_input", "text", None, False)
    assert "retry_after" not in ws_error(bad)


def test_library_errors_in_the_gateway_keep_their_data():
    assert answer_headers(answer_of(Unavailable("redis is down", retry_after_s=5)))["Retry-After"] == "5"
    assert answer_headers(answer_of(Unavailable("redis is down")))["Retry-After"] == "1"
    invalid = answer_of(InvalidInput("seed", "must be an integer"))
    assert (http_status(invalid), invalid.field, invalid.message) == (400, "seed", "seed: must be an integer")
    for local, code in ((Unreachable("redis did not answer"), "unavailable"), (Cancelled("gone"), "unavailable"),
                        (ModelFolderError("no llm.pt"), "internal"), (KeyError("x"), "internal")):
        assert (answer_of(local).code, http_status(answer_of(local))) == (code, 503 if code == "unavailable" else 500)


def test_every_error_is_a_kind_of_the_one_tree_and_every_code_has_one_http_status():
    """The SDK's TTSError, the engines' and parameters' errors and the gateway's answers are kinds of errors.py;
    the gateway answers each code the library defines with a status from its one table (500: internal)."""
    from cosyvoice_triton.errors import DeviceUnavailable, EngineUnavailable, ParameterError
    from cosyvoice_triton.gateway.errors import HTTP_STATUS

    for kind in (TTSError, DeviceUnavailable, EngineUnavailable, ParameterError, *KINDS.values()):
        assert issubclass(kind, CosyVoiceError), kind
    assert {HTTP_STATUS[code][0] for code in ("invalid_input", "not_found", "unavailable", "overloaded", "timeout",
                                              "too_large", "rate_limited", "unauthorized", "forbidden")} == {
        400, 404, 503, 504, 413, 429, 401, 403}


# ---- no prose parsing left -------------------------------------------------------------------------------

ERROR_READERS = ["cosyvoice_triton/errors.py", "cosyvoice_triton/admission.py", "cosyvoice_triton/triton/pb_glue.py",
                 "gateway/triton_channel.py", "gateway/errors.py", "client/common.py"]
OLD_PARSERS = ("_FIELD_MESSAGE", "_BUSY_WORDS", "classify_message", "retry_after_from_message", "_RETRY_AFTER",
               "from_message", "refusal_message", "expiry_message")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", ERROR_READERS)
def test_the_error_readers_use_no_regular_expression(path):
    assert "re" not in _imports(ROOT / path)


def test_the_old_message_parsers_are_gone():
    for folder in ("cosyvoice_triton", "gateway", "client", "model_repository"):
        for path in (ROOT / folder).rglob("*.py"):
            names = {node.id for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Name)}
            names |= {node.attr for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)}
            names |= {node.name for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            assert not names & set(OLD_PARSERS), f"{path.relative_to(ROOT)}: {names & set(OLD_PARSERS)}"


def test_the_client_uses_the_librarys_sample_rate():
    from cosyvoice_triton import audio_out
    from cosyvoice_triton.client import common

    assert common.SAMPLE_RATE is messages.SAMPLE_RATE is audio_out.SAMPLE_RATE == 24000
    tree = ast.parse((ROOT / "client/common.py").read_text())
    assigned = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    assert "SAMPLE_RATE" not in assigned
