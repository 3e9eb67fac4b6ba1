"""The one reader of a decoupled Triton call (`wire/call_reader.py`), blocking and asyncio, on fake calls
(no Triton): outputs, the final flag, empty final responses, error responses, the end of the call without
a final flag, gRPC status errors, skipped responses, the wait for the end of the call and cancellation."""
from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from cosyvoice_triton.errors import Cancelled, DeadlineExceeded, InvalidInput, Unreachable
from cosyvoice_triton.wire import call_reader
from cosyvoice_triton.wire.call_reader import AsyncCallReader, CallReader

END = object()  # the server ends the call (OK) here
HANG = object()  # the server sends nothing more until the call is cancelled


def response(waveform=None, *, final: bool = False, error: str = "", request_id: str = "r") -> object:
    """A `ModelStreamInferResponse`: a waveform chunk, the final flag, an error."""
    result = service_pb2.ModelInferResponse(id=request_id)
    if waveform is not None:
        array = np.asarray(waveform, dtype=np.float32)
        result.outputs.add(name="waveform", datatype="FP32", shape=[array.size])
        result.raw_output_contents.append(array.tobytes())
    if final:
        result.parameters["triton_final_response"].bool_param = True
    return service_pb2.ModelStreamInferResponse(error_message=error, infer_response=result)


def failed_call(code: grpc.StatusCode, details: str) -> grpc.RpcError:
    """A failed call's status, as grpc raises it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeCall:
    """A blocking `ModelStreamInfer` call's side that the reader sees: its responses in order (an
    `grpc.RpcError` is raised where it stands; `END` ends the call; `HANG` waits for a cancel)."""

    def __init__(self, items):
        self.items = list(items)
        self.read_to_end = False
        self._cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        if self._cancelled.is_set():
            raise failed_call(grpc.StatusCode.CANCELLED, "Locally cancelled")
        item = self.items.pop(0) if self.items else END
        if item is HANG:
            self._cancelled.wait()
            raise failed_call(grpc.StatusCode.CANCELLED, "Locally cancelled")
        if item is END:
            self.read_to_end = True
            raise StopIteration
        if isinstance(item, grpc.RpcError):
            self.items = []
            self.read_to_end = True
            raise item
        return item

    def cancel(self) -> None:
        if not self.done():
            self._cancelled.set()

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def done(self) -> bool:
        return self.read_to_end or self.cancelled()


class FakeAioCall(FakeCall):
    """The same, as a `grpc.aio` call: `await read()`, `grpc.aio.EOF` at the end."""

    async def read(self):
        if self.items and self.items[0] is HANG:
            while not self.cancelled():
                await asyncio.sleep(0.001)
        try:
            return next(self)
        except StopIteration:
            return grpc.aio.EOF


def read_blocking(items, **options):
    """(the reader's outputs or the error it raised, the call, how often on_end was called)."""
    call, ends = FakeCall(items), []
    try:
        got = list(CallReader(call, on_end=lambda: ends.append(1), **options))
    except Exception as error:  # noqa: BLE001 - the result under test
        got = error
    return got, call, len(ends)


def read_async(items, **options):
    async def run():
        call, ends = FakeAioCall(items), []
        try:
            got = [outputs async for outputs in AsyncCallReader(call, on_end=lambda: ends.append(1), **options)]
        except Exception as error:  # noqa: BLE001 - the result under test
            got = error
        return got, call, len(ends)

    return asyncio.run(run())


FACES = pytest.mark.parametrize("read", [read_blocking, read_async], ids=["blocking", "asyncio"])


@FACES
def test_outputs_until_the_empty_final_response_then_the_call_ends_with_ok(read):
    got, call, ends = read([response([1, 2]), response([3]), response(final=True), END])
    assert [outputs["waveform"].tolist() for outputs in got] == [[1, 2], [3]]
    assert call.read_to_end and not call.cancelled() and ends == 1


@FACES
def test_a_final_response_with_outputs_hands_them_out(read):
    got, call, _ = read([response([5, 6], final=True), END])
    assert [outputs["waveform"].tolist() for outputs in got] == [[5, 6]]
    assert call.read_to_end and not call.cancelled()


@FACES
def test_an_error_response_raises_the_models_error_kind_and_lets_the_call_end(read):
    wire = InvalidInput("seed", "must be an integer").to_wire()
    got, call, ends = read([response([1]), response(error=wire), END])
    assert isinstance(got, InvalidInput) and (got.field, got.problem) == ("seed", "must be an integer")
    assert call.read_to_end and not call.cancelled() and ends == 1


@FACES
def test_the_end_of_the_call_without_a_final_response_is_a_failure(read):
    got, call, ends = read([response([1]), END])
    assert isinstance(got, Unreachable) and "final response" in str(got)
    assert ends == 1


@FACES
@pytest.mark.parametrize("code, kind", [(grpc.StatusCode.UNAVAILABLE, Unreachable),
                                        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
                                        (grpc.StatusCode.CANCELLED, Cancelled)])
def test_a_grpc_status_error_is_read_by_from_wire(read, code, kind):
    got, _, ends = read([response([1]), failed_call(code, "connection reset")])
    assert type(got) is kind and "connection reset" in str(got) and ends == 1


@FACES
@pytest.mark.parametrize("items, status", [([response(error="boom")], None), ([END], "UNAVAILABLE"),
                                          ([failed_call(grpc.StatusCode.DEADLINE_EXCEEDED, "late")], "DEADLINE_EXCEEDED")])
def test_a_caller_raises_its_own_error_type_with_the_status(read, items, status):
    class CallerError(Exception):
        pass

    got, _, _ = read(items, as_error=lambda error, status: CallerError(error, status))
    assert isinstance(got, CallerError) and got.args[1] == status


@FACES
def test_responses_of_other_requests_on_the_call_are_skipped_with_their_final_flag(read):
    items = [response(final=True, request_id="r/text/1"), response([1]), response(final=True), END]
    got, call, _ = read(items, skip=lambda result: result.id.startswith("r/text/"))
    assert [outputs["waveform"].tolist() for outputs in got] == [[1]] and call.read_to_end


@FACES
def test_a_server_that_does_not_end_the_call_after_the_final_response_is_cancelled(read, monkeypatch):
    monkeypatch.setattr(call_reader, "STREAM_END_WAIT_S", 0.01)
    got, call, _ = read([response([1]), response(final=True), HANG])
    assert len(got) == 1 and call.cancelled()


def test_closing_a_blocking_reader_early_cancels_the_call():
    call, ends = FakeCall([response([1]), response([2]), response(final=True), END]), []
    reader = CallReader(call, on_end=lambda: ends.append(1))
    assert next(reader)["waveform"].tolist() == [1]
    reader.close()
    assert call.cancelled() and ends == [1]
    assert list(reader) == []
    reader.close()
    assert ends == [1]


def test_closing_a_finished_reader_does_not_cancel():
    call = FakeCall([response([1], final=True), END])
    reader = CallReader(call)
    assert len(list(reader)) == 1
    reader.close()
    assert not call.cancelled()


def test_closing_an_asyncio_reader_early_cancels_the_call():
    async def run():
        call, ends = FakeAioCall([response([1]), response(final=True), END]), []
        reader = AsyncCallReader(call, on_end=lambda: ends.append(1))
        assert (await anext(reader))["waveform"].tolist() == [1]
        await reader.aclose()
        return call, ends

    call, ends = asyncio.run(run())
    assert call.cancelled() and ends == [1]


def test_a_task_cancelled_while_it_waits_cancels_the_call():
    async def run():
        call, ends = FakeAioCall([response([1]), HANG]), []
        reader = AsyncCallReader(call, on_end=lambda: ends.append(1))
        await anext(reader)
        waiting = asyncio.create_task(anext(reader))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return call, ends

    call, ends = asyncio.run(run())
    assert call.cancelled() and ends == [1]


@pytest.mark.parametrize("items, which", [([HANG], "first"), ([response([1]), HANG], "next")])
def test_no_response_within_the_timeout_raises_deadline_exceeded_and_cancels(items, which):
    got, call, ends = read_async(items, first_timeout_s=0.01, next_timeout_s=0.01)
    assert isinstance(got, DeadlineExceeded) and f"no {which} response" in str(got)
    assert call.cancelled() and ends == 1
