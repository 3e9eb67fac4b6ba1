"""WS /v1/tts/ws: text in as it is written, audio out as it is made (the messages: docs/api/websocket.md#messages).

The start message is parsed once into a `StartMessage` (route_requests.py) and its voice settled once
(`synthesis.prepare`); each segment is that wire request with its own text and seed, a Triton request of its
own, routed one by one and sent strictly in order. A client that goes away cancels every running segment.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from contextlib import aclosing, suppress
from dataclasses import dataclass, field, replace

from aiohttp import WSCloseCode, WSMsgType, web

from cosyvoice_triton.errors import Cancelled, CosyVoiceError, Draining, InvalidInput, SessionTimeout, TooLarge
from cosyvoice_triton.audio_out import AudioEncoder, audio_format
from cosyvoice_triton.messages import SEED_LIMIT
from cosyvoice_triton.pipeline.audible import AudibleDetector
from cosyvoice_triton.pipeline.speech_marks import MARK_END, mark_message, shifted
from cosyvoice_triton.wire.requests import ConversionInputs, SynthesisInputs

from . import access_log, admission
from .auth import limit_key
from .errors import answer_of, http_status, ws_error
from .fields import TTS_FIELDS
from .route_requests import optional_text, parse_start, parse_vc_message
from .request_keys import CLIENT_LEFT
from .state import CONFIG, DRAIN, LIMITER, METRICS, ROUTER, WEBSOCKETS
from .synthesis import (WireRequest, check_ssml_voices, conversion_in_voice, prepare, routing_cost, ssml_voice_ids,
                        stream_audio)
from .ws_bistream import BistreamText

log = logging.getLogger(__name__)

SEGMENT_SEED_STRIDE = 1000
# A sentence is complete at an end mark followed by white space, a CJK end mark, or a newline.
_BOUNDARY = re.compile(r"[.!?;]+[\"'”’)\]]*\s+|[。！？；…]+[\"”’」』）)]*\s*|\n+")
_DONE = object()


class SentenceBuffer:
    """Text arriving in pieces -> segments of complete sentences, at most `max_chars` each."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.text = ""

    def feed(self, text: str) -> list[str]:
        self.text += text
        cut = 0
        for match in _BOUNDARY.finditer(self.text):
            cut = match.end()
        ready, self.text = self.text[:cut], self.text[cut:]
        pieces = self._split(ready)
        while len(self.text) > self.max_chars:  # no sentence end for too long: cut at a space
            space = self.text.rfind(" ", 0, self.max_chars)
            at = space + 1 if space > 0 else self.max_chars
            pieces.append(self.text[:at])
            self.text = self.text[at:]
        return [p for p in pieces if _speakable(p)]

    def flush(self) -> list[str]:
        rest, self.text = self.text, ""
        return [p for p in self._split(rest) if _speakable(p)]

    def _split(self, text: str) -> list[str]:
        """`text` as one segment, or at sentence ends into segments of at most max_chars."""
        if len(text) <= self.max_chars:
            return [text] if text else []
        pieces, current, start = [], "", 0
        for match in _BOUNDARY.finditer(text):
            sentence = text[start:match.end()]
            start = match.end()
            if current and len(current) + len(sentence) > self.max_chars:
                pieces.append(current)
                current = ""
            current += sentence
        current += text[start:]
        while len(current) > self.max_chars:
            pieces.append(current[:self.max_chars])
            current = current[self.max_chars:]
        return pieces + ([current] if current else [])


def _speakable(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


@dataclass(frozen=True)
class SegmentText:
    text: str
    offset: int  # of its first character in the session's text (speech mark spans)
    ssml_voices: frozenset[str] | None = None  # an SSML document's <voice name>s, read when it came (None: not yet)


@dataclass(eq=False)
class Segment:
    index: int
    text: str
    submitted: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # chunks (and mark events), then _DONE or an exception
    task: asyncio.Task | None = None
    offset: int = 0  # of its text in the session's text


class Session:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse):
        self.request = request
        self.app = request.app
        self.ws = ws
        self.config = self.app[CONFIG]
        self.drain = self.app[DRAIN]
        self.held = 0  # segments queued and not yet sent: counted in the drain's in_flight
        self.refusal: Draining | None = None  # a message refused while draining: sent in place of "end"
        self.request_id = uuid.uuid4().hex
        self.base: SynthesisInputs | None = None  # the start message's request, its voice settled
        self.family: str | None = None  # the model family of every segment (the start message's `model`)
        self.prompt_tokens = 0  # of the voice: each segment's cost share
        self.fmt = audio_format("pcm_f32")
        self.encoder: AudioEncoder | None = None  # one file across the session's segments
        self.buffer = SentenceBuffer(self.config.limits.max_text_chars)
        self.pending: asyncio.Queue[str | None] = asyncio.Queue()  # segment texts; None: end
        self.order: asyncio.Queue[Segment | None] = asyncio.Queue()  # started segments, in order
        self.ahead = asyncio.Semaphore(max(1, self.config.ws_pipeline_depth))
        self.segments: list[Segment] = []
        self.sent = 0  # segments whose audio is all sent
        self.received_chars = 0
        self.started = time.monotonic()
        self.first_chunk_ms: float | None = None
        self.first_submitted = 0.0  # when the segment with the first chunk was submitted: both times' origin
        self.audible = AudibleDetector(self.config.sample_rate, self.config.audible_threshold_dbfs)
        self.first_audible_ms: float | None = None
        self.audio_seconds = 0.0
        self.text = ""  # every text received (speech mark spans count in it) ...
        self.text_cursor = 0  # ... and where the next segment's text is looked for
        self.samples = 0  # audio samples sent, across segments (speech mark times count them)
        self.marks = 0  # speech marks sent (their indexes count them)
        self.ended = False
        self.bistream: BistreamText | None = None  # text_mode bistream: the text goes to one synthesis

    # ---- the session -----------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._start(await self._receive_json())
        except (Cancelled, ConnectionError):  # left before it started: nothing was synthesized
            self.request[CLIENT_LEFT] = True
            return
        except Exception as exc:  # noqa: BLE001 - reported to the client
            await self._fail(answer_of(exc))
            return
        metrics = self.app[METRICS]
        metrics.active_streams.labels("ws").inc()
        starter = self._start_bistream() if self.bistream is not None else self._start_segments()
        tasks = [asyncio.create_task(self._read()), asyncio.create_task(starter),
                 asyncio.create_task(self._send())]
        reader, _, sender = tasks
        try:
            done, _ = await asyncio.wait({reader, sender}, return_when=asyncio.FIRST_COMPLETED)
            error = session_error(done)
            if isinstance(error, Draining):
                error = await self._finish_accepted(sender, error)
            if client_left(error):
                finished = sender in done and not sender.cancelled() and sender.exception() is None
                self.request[CLIENT_LEFT] = not finished  # left before its audio was all sent
            elif error is not None:
                await self._stop(tasks)
                await self._fail(answer_of(error))
            elif sender in done and error is None:
                await self._stop(tasks)
                await self.ws.close()
        finally:
            await self._stop(tasks)  # the client left (reader done): cancels the Triton streams
            self._release(self.held)
            self.encoder.close()
            metrics.active_streams.labels("ws").dec()
            metrics.audio_seconds.labels("ws").inc(self.audio_seconds)
            if self.first_chunk_ms is not None:
                access_log.first_chunk(self.request, self.first_chunk_ms / 1000)
            if self.first_audible_ms is not None:
                access_log.first_audible(self.request, self.first_audible_ms / 1000)
            access_log.audio_sent(self.request, self.audio_seconds)

    async def _finish_accepted(self, sender: asyncio.Task, refusal: Draining) -> Exception:
        """Draining refused a message: what was asked for before it is synthesized and sent, then the
        refusal ends the session in place of "end" (or the error the sender met first)."""
        self.refusal = refusal
        self.pending.put_nowait(None)  # no segment after those already queued
        try:
            await sender
        except Exception as exc:  # noqa: BLE001 - reported to the client
            return exc
        return refusal

    async def _start(self, message: dict) -> None:
        if message.get("type") != "start":
            raise InvalidInput("type", "the first message must be {\"type\": \"start\", ...}")
        self.drain.refuse_new()
        start = parse_start(message, self.config.limits)
        self.family = self.app[ROUTER].family_for(start.model)
        self.fmt = start.format
        self.bistream = BistreamText() if start.inputs.text_mode == "bistream" else None
        self.base, self.prompt_tokens = await prepare(self.app, start.inputs, TTS_FIELDS)
        await self.ws.send_json({"type": "started", "request_id": self.request_id, "model": self.family,
                                 "sample_rate": self.fmt.output_rate(self.config.sample_rate),
                                 "format": self.fmt.name, "seed": self.base.seed})
        self.encoder = AudioEncoder(self.fmt, self.config.sample_rate)
        if start.text is not None:
            self._add_text(start.text)

    async def _read(self) -> None:
        """Client messages until it closes (after "end" too, to notice it leaving)."""
        while True:
            message = await self._receive_json()
            kind = message.get("type")
            if self.ended:
                raise InvalidInput("type", "no messages are accepted after \"end\"")
            if kind == "text":
                self._add_text(message.get("text"))
            elif kind == "flush":
                self._queue(self.buffer.flush())
            elif kind == "end" and self.bistream is not None:
                self.bistream.end()
                self.ended = True
            elif kind == "end":
                self._queue(self.buffer.flush())
                self.pending.put_nowait(None)
                self.ended = True
            elif kind == "vc" and self.bistream is not None:
                raise InvalidInput("type", "a bistream session takes text only (vc needs text_mode sentences)")
            elif kind == "vc":  # a recording to speak again in the session's voice, after the text before it
                self.drain.refuse_new()
                source, fields = parse_vc_message(message, self.config.limits)
                conversion = await conversion_in_voice(self.base, source, fields)
                self._queue([*self.buffer.flush(), conversion])
            else:
                raise InvalidInput("type", f"must be text, flush, vc or end, got {kind!r}")

    def _add_text(self, text: object) -> None:
        if not isinstance(text, str):
            raise InvalidInput("text", f"must be a string, got {type(text).__name__}")
        # Refused as it comes, not when its sentence is complete: a piece without a sentence end would
        # otherwise wait in the buffer until the idle timeout.
        optional_text(text, "text")
        self.received_chars += len(text)
        if self.received_chars > self.config.limits.max_session_chars:
            raise TooLarge(f"text: a session takes at most {self.config.limits.max_session_chars} "
                           "characters", field="text")
        if self.bistream is not None:
            self.bistream.put(text)
            return
        self.text += text
        if self.base.text_type == "ssml":  # one whole document: one segment, checked now
            document = replace(self.base, text=text)
            with TTS_FIELDS.named():
                document.check(self.config.limits.max_text_chars)
            voices = ssml_voice_ids(document, TTS_FIELDS)
            self.text_cursor = len(self.text) - len(text)
            self._queue([text], voices)
            return
        self._queue(self.buffer.feed(text))

    def _queue(self, items: list[str | ConversionInputs], ssml_voices: frozenset[str] | None = None) -> None:
        """New segments (refused while draining), held in the drain's count until they are sent."""
        if not items:
            return
        self.drain.refuse_new()
        for item in items:
            self.pending.put_nowait(self._located(item, ssml_voices) if isinstance(item, str) else item)
        self.held += len(items)
        self.drain.in_flight += len(items)

    def _located(self, text: str, ssml_voices: frozenset[str] | None) -> SegmentText:
        """A segment's text with its place in the session's text (segments come in order, each a piece of it)."""
        offset = self.text.find(text, self.text_cursor)
        offset = self.text_cursor if offset < 0 else offset
        self.text_cursor = offset + len(text)
        return SegmentText(text, offset, ssml_voices)

    def _release(self, count: int) -> None:
        self.held -= count
        self.drain.in_flight -= count

    async def _start_segments(self) -> None:
        while (item := await self.pending.get()) is not None:
            await self.ahead.acquire()  # released by the sender once the segment is sent
            index = len(self.segments)
            seed = (self.base.seed + SEGMENT_SEED_STRIDE * index) % SEED_LIMIT
            if isinstance(item, ConversionInputs):  # a vc message: its own request, with the segment's seed
                inputs, text, voices = replace(item, seed=seed), "", frozenset()
            else:  # the session's voice and settings with this segment's text
                inputs, text, voices = replace(self.base, text=item.text, seed=seed), item.text, item.ssml_voices
            segment = Segment(index, text, time.monotonic(), offset=0 if isinstance(item, ConversionInputs)
                              else item.offset)
            cost = routing_cost(self.app, inputs, self.prompt_tokens)
            segment.task = asyncio.create_task(self._synthesize(segment, inputs, cost, voices))
            self.segments.append(segment)
            self.order.put_nowait(segment)
        self.order.put_nowait(None)

    async def _start_bistream(self) -> None:
        """text_mode bistream: one segment, synthesized as its text comes (gateway/ws_bistream.py)."""
        segment = Segment(0, "", time.monotonic())
        segment.task = asyncio.create_task(self._bistream_segment(segment))
        self.segments.append(segment)
        self.order.put_nowait(segment)
        self.order.put_nowait(None)

    async def _bistream_segment(self, segment: Segment) -> None:
        cost = routing_cost(self.app, self.base, self.prompt_tokens)
        admission.ON_QUEUED.set(segment.queue.put_nowait)
        await self.bistream.run(self.app, self.base, cost, TTS_FIELDS, segment.queue, f"{self.request_id}-0", _DONE,
                                self.family)
        segment.text = self.bistream.text

    async def _synthesize(self, segment: Segment, inputs: WireRequest, cost: float,
                          ssml_voices: frozenset[str] | None) -> None:
        admission.ON_QUEUED.set(segment.queue.put_nowait)  # this task's own context: its queue place
        try:
            if isinstance(inputs, SynthesisInputs):  # SSML: each <voice name>, as voice_id
                voices = ssml_voice_ids(inputs, TTS_FIELDS) if ssml_voices is None else ssml_voices
                await check_ssml_voices(self.app, voices, inputs.mode, TTS_FIELDS)
            chunks = stream_audio(self.app, inputs, cost, TTS_FIELDS, f"{self.request_id}-{segment.index}",
                                  self.family)
            async with aclosing(chunks):
                async for chunk in chunks:
                    segment.queue.put_nowait(chunk)
            segment.queue.put_nowait(_DONE)
        except Exception as exc:  # noqa: BLE001 - handed to the sender
            segment.queue.put_nowait(exc)

    async def _send(self) -> None:
        metrics = self.app[METRICS]
        while (segment := await self.order.get()) is not None:
            samples, first_ms, marks_before, samples_before = 0, None, self.marks, self.samples
            while (item := await segment.queue.get()) is not _DONE:
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, dict):  # a speech mark event, in the session's terms: before its audio
                    await self.ws.send_json(mark_message(shifted(item, samples_before, segment.offset, marks_before)))
                    self.marks += item.get("type") != MARK_END
                    continue
                if isinstance(item, admission.QueuePlace):
                    await self.ws.send_json({"type": "queued", "index": segment.index, "position": item.position,
                                             "expected_start_s": round(item.expected_start_s, 2)})
                    continue
                if first_ms is None:
                    first_ms = (time.monotonic() - segment.submitted) * 1000
                    if self.first_chunk_ms is None:
                        self.first_chunk_ms, self.first_submitted = first_ms, segment.submitted
                        metrics.first_chunk.labels("ws").observe(first_ms / 1000)
                self._time_audible(self.audible.feed(item, time.monotonic()))
                await self._send_audio(self.encoder.feed(item))
                samples += item.size
                self.samples += item.size
            seconds = samples / self.config.sample_rate
            self.audio_seconds += seconds
            self.ahead.release()
            self.sent += 1
            if self.bistream is None:  # a bistream segment is not queued: its Triton call is what counts
                self._release(1)
            await self.ws.send_json({"type": "segment", "index": segment.index, "text": segment.text,
                                     "audio_seconds": seconds, "first_chunk_ms": first_ms})
        self._time_audible(self.audible.finish())
        await self._send_audio(self.encoder.finish())
        if self.refusal is not None:
            raise self.refusal
        await self.ws.send_json({"type": "end", "segments": len(self.segments), "audio_seconds": self.audio_seconds,
                                 "first_chunk_ms": self.first_chunk_ms, "first_audible_ms": self.first_audible_ms,
                                 "elapsed_ms": (time.monotonic() - self.started) * 1000})

    def _time_audible(self, found: bool) -> None:
        """`found`: the session's first audible sample was just found; its chunk was sent at `audible.at`."""
        if found:
            self.first_audible_ms = (self.audible.at - self.first_submitted) * 1000
            self.app[METRICS].first_audible.labels("ws").observe(self.first_audible_ms / 1000)

    async def _send_audio(self, data: bytes) -> None:
        if data:  # encoders hold a few ms of audio until they have a whole frame
            await self.ws.send_bytes(data)

    # ---- helpers ------------------------------------------------------------------------------------------
    async def _receive(self):
        """The next client message; SessionTimeout after `ws_idle_timeout_s` without one while nothing is
        in flight (the wait goes on while segments are pending or unsent, and without limit after end)."""
        idle_s = self.config.limits.ws_idle_timeout_s
        while True:
            try:
                return await asyncio.wait_for(self.ws.receive(), None if self.ended else idle_s)
            except asyncio.TimeoutError:
                if self.pending.empty() and self.sent == len(self.segments):
                    raise SessionTimeout("idle_timeout", f"no message for {idle_s:g} s and nothing to "
                                                         "synthesize: the session is closed") from None

    async def _receive_json(self) -> dict:
        message = await self._receive()
        if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
            raise Cancelled("the client closed the WebSocket")
        if message.type != WSMsgType.TEXT:
            raise InvalidInput("type", "messages must be JSON text frames")
        try:
            data = json.loads(message.data)
        except ValueError:
            raise InvalidInput("message", "is not valid JSON") from None
        if not isinstance(data, dict):
            raise InvalidInput("message", "must be a JSON object")
        return data

    async def _stop(self, tasks: list[asyncio.Task]) -> None:
        """Cancel what still runs (Triton streams included) and collect every task's outcome."""
        every = tasks + [s.task for s in self.segments if s.task is not None]
        for task in every:
            task.cancel()
        for task in every:
            with suppress(asyncio.CancelledError, Exception):
                await task

    async def _fail(self, error: CosyVoiceError) -> None:
        self.app[METRICS].errors.labels(error.code).inc()
        if self.ws.closed:
            return
        with suppress(ConnectionError, RuntimeError):
            await self.ws.send_json(ws_error(error))
            code = WSCloseCode.POLICY_VIOLATION if http_status(error) < 500 else WSCloseCode.INTERNAL_ERROR
            await self.ws.close(code=code, message=error.code.encode())


def client_left(error: BaseException | None) -> bool:
    """The client closed or cut the connection: a cancellation by the client, not a failure of ours."""
    return isinstance(error, (Cancelled, ConnectionError))


def session_error(done: set[asyncio.Task]) -> BaseException | None:
    """What ended a session's reader or sender. When the client left, a send that failed because of it
    (ConnectionResetError on a closing socket) is the same event, never an internal error."""
    errors = [task.exception() for task in done if not task.cancelled() and task.exception() is not None]
    return next((e for e in errors if client_left(e)), errors[0] if errors else None)


async def tts_ws(request: web.Request) -> web.WebSocketResponse:
    app = request.app
    config = app[CONFIG]
    with app[LIMITER].slot(limit_key(request)):  # 429 before the upgrade
        ws = web.WebSocketResponse(heartbeat=config.ws_heartbeat_s, max_msg_size=config.limits.max_upload_bytes * 2)
        await ws.prepare(request)
        app[WEBSOCKETS].add(ws)
        session = Session(request, ws)
        try:
            await asyncio.wait_for(session.run(), config.limits.ws_session_timeout_s)
        except asyncio.TimeoutError:
            await session._fail(SessionTimeout("session_timeout", "the session is longer than "
                                               f"{config.limits.ws_session_timeout_s:g} s: it is closed"))
        finally:
            app[WEBSOCKETS].discard(ws)
            if not ws.closed:
                await ws.close()
    return ws


async def close_websockets(app: web.Application) -> None:
    """on_shutdown: tell every client the server is going away."""
    for ws in list(app[WEBSOCKETS]):
        with suppress(Exception):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/tts/ws", tts_ws)
    app.on_shutdown.append(close_websockets)

