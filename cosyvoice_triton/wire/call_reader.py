"""The one reader of a decoupled Triton call (gRPC `ModelStreamInfer`), blocking (`CallReader`) and asyncio
(`AsyncCallReader`), for every client of a Triton server: the gateway, the SDK, the liveness probe, the llm stage.
Both iterate the outputs of each response and share `_Reading`, which says what a response means; a caller with
its own error type passes `as_error`. It never ends a failed call as a clean end, and never cancels a finished
call before the server ends it (why: docs/architecture/layout.md#the-wire-package).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from cosyvoice_triton.errors import CosyVoiceError, DeadlineExceeded, Unreachable, from_wire
from cosyvoice_triton.wire.grpc_messages import STREAM_END_WAIT_S, is_final, response_outputs

Outputs = dict[str, np.ndarray]
Skip = Callable[[service_pb2.ModelInferResponse], bool]
# A caller's own error for the library's error and the gRPC status name it came with (None for a model's
# error response): the gateway's `RemoteError`, the SDK's `TTSError`. By default the error itself.
AsError = Callable[[CosyVoiceError, str | None], Exception]


def status_error(error: grpc.RpcError) -> CosyVoiceError:
    """A failed gRPC call's status as the library's error (UNAVAILABLE -> Unreachable, ...)."""
    details = error.details() if hasattr(error, "details") else str(error)
    return from_wire(details or "", status_name(error))


def status_name(error: grpc.RpcError) -> str | None:
    code = error.code() if hasattr(error, "code") else None
    return code.name if code is not None else None


def _as_is(error: CosyVoiceError, status: str | None) -> Exception:
    return error


class _Reading:
    """What the responses of one call mean, and where its reading stands: the logic both readers share."""

    def __init__(self, skip: Skip | None, on_end: Callable[[], None] | None, as_error: AsError):
        self.finished = False  # the final (or an error) response came: the server ends the call
        self.over = False  # nothing more to read: finished, failed or closed
        self.produced = False  # some response had outputs
        self._skip = skip
        self._on_end = on_end
        self._as_error = as_error

    def take(self, response: service_pb2.ModelStreamInferResponse) -> Outputs | None:
        """The response's outputs (None when it has none); raises the error of an error response."""
        if response.error_message:
            self._stop(finished=True)
            raise self._as_error(from_wire(response.error_message), None)
        result = response.infer_response
        if self._skip is not None and self._skip(result):
            return None
        if is_final(result):
            self._stop(finished=True)
        if not result.outputs:
            return None
        self.produced = True
        return response_outputs(result)

    def failed(self, error: CosyVoiceError, status: str | None) -> Exception:
        """The reading ends with `error` (to raise): the call failed, ended early or timed out."""
        self._stop(finished=False)
        return self._as_error(error, status)

    def call_failed(self, error: grpc.RpcError) -> Exception:
        return self.failed(status_error(error), status_name(error))

    def ended_early(self) -> Exception:
        return self.failed(Unreachable("the server ended the stream before its final response"), "UNAVAILABLE")

    def timed_out(self, timeout_s: float) -> Exception:
        which = "next" if self.produced else "first"
        return self.failed(DeadlineExceeded(f"no {which} response within {timeout_s:g} s"), "DEADLINE_EXCEEDED")

    def close(self) -> bool:
        """Whether the call is to be cancelled: the caller stops before the end."""
        if self.over:
            return False
        self._stop(finished=False)
        return True

    def _stop(self, finished: bool) -> None:
        self.over, self.finished = True, finished
        if self._on_end is not None:
            self._on_end()


class CallReader:
    """The outputs of a blocking `ModelStreamInfer` call's responses (see the module docstring). Iterate it;
    `close()` before the end cancels the call."""

    def __init__(self, call, *, skip: Skip | None = None, on_end: Callable[[], None] | None = None,
                 as_error: AsError = _as_is):
        self.call = call
        self._reading = _Reading(skip, on_end, as_error)

    def __iter__(self) -> CallReader:
        return self

    def __next__(self) -> Outputs:
        while not self._reading.over:
            response = self._read()
            try:
                outputs = self._reading.take(response)
            finally:
                if self._reading.over:
                    self._end()
            if outputs is not None:
                return outputs
        raise StopIteration

    def _read(self) -> service_pb2.ModelStreamInferResponse:
        try:
            return next(self.call)
        except StopIteration:
            error = self._reading.ended_early()
        except grpc.RpcError as rpc_error:
            error = self._reading.call_failed(rpc_error)
        self._end()
        raise error

    def _end(self) -> None:
        """Let a finished call end (bounded), cancel anything else."""
        if not self._reading.finished:
            if not self.call.done():
                self.call.cancel()
            return
        timer = threading.Timer(STREAM_END_WAIT_S, self.call.cancel)  # a server that does not end it
        timer.start()
        try:
            for _ in self.call:
                pass
        except grpc.RpcError:
            pass
        finally:
            timer.cancel()

    def close(self) -> None:
        if self._reading.close():
            self.call.cancel()


class AsyncCallReader:
    """The outputs of a `grpc.aio` `ModelStreamInfer` call's responses (see the module docstring):
    `async for`; `await aclose()` before the end cancels the call (iterate it inside
    `contextlib.aclosing`). `first_timeout_s`/`next_timeout_s`: the longest wait for a response before
    (after) the first one with outputs (None: no limit)."""

    def __init__(self, call, *, skip: Skip | None = None, on_end: Callable[[], None] | None = None,
                 as_error: AsError = _as_is, first_timeout_s: float | None = None,
                 next_timeout_s: float | None = None):
        self.call = call
        self._reading = _Reading(skip, on_end, as_error)
        self._first_timeout_s, self._next_timeout_s = first_timeout_s, next_timeout_s

    def __aiter__(self) -> AsyncCallReader:
        return self

    async def __anext__(self) -> Outputs:
        while not self._reading.over:
            response = await self._read()
            try:
                outputs = self._reading.take(response)
            finally:
                if self._reading.over:
                    await self._end()
            if outputs is not None:
                return outputs
        raise StopAsyncIteration

    async def _read(self) -> service_pb2.ModelStreamInferResponse:
        timeout_s = self._next_timeout_s if self._reading.produced else self._first_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.call.read()
        except TimeoutError:
            error = self._reading.timed_out(timeout_s)
        except grpc.RpcError as rpc_error:
            error = self._reading.call_failed(rpc_error)
        except asyncio.CancelledError:  # the caller went away while it waited
            await self.aclose()
            raise
        else:
            if response is not grpc.aio.EOF:
                return response
            error = self._reading.ended_early()
        await self._end()
        raise error

    async def _end(self) -> None:
        """Let a finished call end (bounded), cancel anything else."""
        try:
            if self._reading.finished:
                async with asyncio.timeout(STREAM_END_WAIT_S):
                    while await self.call.read() is not grpc.aio.EOF:
                        pass
        except (TimeoutError, grpc.RpcError):
            pass
        finally:
            if not self.call.done():
                self.call.cancel()

    async def aclose(self) -> None:
        if self._reading.close():
            self.call.cancel()
