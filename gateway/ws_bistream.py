"""The WebSocket's `"text_mode": "bistream"`: the session's text goes to one synthesis as it is written.

Instead of one Triton request per complete sentence, the session opens one bistream request on one server
(`text_mode` bistream, `text_stream_id`: wire/requests.py) and hands it every text message as it comes, in
order, as text_append requests to the same server (the last with text_end). The LLM reads the text as it
arrives, in the trained 5:15 text/speech pattern (llm/bistream.py), so audio starts before the first
sentence is complete. The audio comes back as one segment (index 0) of the session.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace

import numpy as np

from cosyvoice_triton.errors import RemoteError
from cosyvoice_triton.wire.requests import SynthesisInputs, TextAppend

from .errors import upstream
from .fields import Fields
from .state import CONFIG, METRICS, ROUTER


class BistreamText:
    """One session's text pieces, from its reader to the server, in order (None: the end)."""

    def __init__(self) -> None:
        self.pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self.text = ""  # everything received, for the segment message

    def put(self, text: str) -> None:
        self.text += text
        self.pieces.put_nowait(text)

    def end(self) -> None:
        self.pieces.put_nowait(None)

    async def run(self, app, inputs: SynthesisInputs, cost: float, fields: Fields, out: asyncio.Queue, stream_id: str,
                  done: object, family: str) -> None:
        """Stream the synthesis's chunks (`inputs`: text_mode bistream, the session's voice and settings) from a
        server of `family` into `out`, then `done` (or the exception that ended it), while its text goes to the
        same server. Not retried elsewhere: the server holds the text read so far."""
        try:
            await self._run(app, replace(inputs, text_stream_id=stream_id), cost, out, family)
            out.put_nowait(done)
        except RemoteError as exc:
            out.put_nowait(upstream(exc, fields))
        except Exception as exc:  # noqa: BLE001 - handed to the sender
            out.put_nowait(exc)

    async def _run(self, app, inputs: SynthesisInputs, cost: float, out: asyncio.Queue, family: str) -> None:
        router, config = app[ROUTER], app[CONFIG]
        server = router.pick(family=family)
        model = router.models[family][0]
        app[METRICS].routed.labels(server.name).inc()
        # The text may pause for as long as the session may be idle: the wait for audio allows that too.
        wait_s = config.limits.ws_idle_timeout_s + config.routing.first_chunk_timeout_s
        stream_id = inputs.text_stream_id
        with router.lease(server, cost):
            appender = asyncio.create_task(self._append(server, model, stream_id, wait_s))
            try:
                chunks = server.client.stream(model, inputs.tensors(), stream_id,
                                              first_timeout_s=wait_s, chunk_timeout_s=wait_s)
                async with aclosing(chunks):
                    async for chunk in chunks:
                        if appender.done() and appender.exception() is not None:
                            raise appender.exception()
                        out.put_nowait(np.asarray(chunk))
            finally:
                appender.cancel()

    async def _append(self, server, model: str, stream_id: str, wait_s: float) -> None:
        """Each piece as one text_append request, each answered before the next is sent (so they stay in order)."""
        index = 0
        while True:
            piece = await self.pieces.get()
            index += 1
            end = piece is None
            answers = server.client.stream(model, TextAppend(stream_id, piece or "", end).tensors(),
                                           f"{stream_id}-text-{index}", first_timeout_s=wait_s, chunk_timeout_s=wait_s)
            async with aclosing(answers):
                async for _ in answers:
                    pass
            if end:
                return
