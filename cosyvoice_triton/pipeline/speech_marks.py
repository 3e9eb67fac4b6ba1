"""Speech marks: what is said when, in the output audio (docs/api/speech-marks.md).

A mark is one sentence, SSML <mark> or SSML <break> of a request, as JSON:

  {"type": "sentence" | "mark" | "break", "index": 0, "start_ms": 0.0, "end_ms": 1250.0,
   "start": 0, "end": 12, "value": "Hello there."}

start_ms/end_ms: where it is in the request's output audio, counted from the samples made before it (24 kHz,
after speed), so exact to the sample (ms rounded to 3 decimals: `samples_of` gives the samples back). start/end:
its character span in the request's text (plain text: the source of each sentence the text preprocessor spoke,
preprocess/spans.py; SSML: the parser's spans). value: the sentence as written (SSML: its tags removed), the
mark's name, the break's length ("500ms"). A <mark> is a point (start_ms == end_ms). `index` is its order in the
request. Marks are sentence-level: nothing the model makes says when a word is spoken (the LLM's text and speech
tokens are not aligned), and an aligner would need weights the model folder does not have.

The pipeline yields marks among the audio chunks, each before the first sample it describes. A sentence's end is
known only once its last chunk is made, so a sentence mark goes out with end_ms null and a `MarkEnd`
({"type": "mark_end", "index": 0, "end_ms": 1250.0}) follows its last audio. Breaks and <mark>s are complete
when sent. `MarkList` folds the events back into complete marks (a client's, the gateway's whole answers).
"""
from __future__ import annotations

import html
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ..messages import SAMPLE_RATE

SENTENCE, MARK, BREAK = "sentence", "mark", "break"  # a mark's type
MARK_END = "mark_end"  # the event that ends a sentence mark
_TAG = re.compile(r"<[^>]*>")


def ms(samples: int) -> float:
    """Samples at 24 kHz as milliseconds, rounded to 3 decimals (a µs; `samples_of` inverts it exactly)."""
    return round(samples * 1000 / SAMPLE_RATE, 3)


def samples_of(milliseconds: float) -> int:
    """The sample count behind a mark's milliseconds (`ms` rounds to 1/24 of a sample)."""
    return round(milliseconds * SAMPLE_RATE / 1000)


@dataclass(frozen=True)
class SpeechMark:
    index: int
    type: str  # SENTENCE | MARK | BREAK
    start_sample: int
    end_sample: int | None  # None: a sentence still being spoken (its MarkEnd follows its audio)
    span: tuple[int, int]  # characters of the request text
    value: str

    def to_json(self) -> dict:
        return {"type": self.type, "index": self.index, "start_ms": ms(self.start_sample),
                "end_ms": None if self.end_sample is None else ms(self.end_sample),
                "start": self.span[0], "end": self.span[1], "value": self.value}


@dataclass(frozen=True)
class MarkEnd:
    index: int
    end_sample: int

    def to_json(self) -> dict:
        return {"type": MARK_END, "index": self.index, "end_ms": ms(self.end_sample)}


MarkEvent = SpeechMark | MarkEnd


class MarkClock:
    """Counts one request's output samples and numbers its marks, in the order the audio is made."""

    def __init__(self):
        self.samples = 0
        self.count = 0

    def _mark(self, kind: str, end_sample: int | None, span: tuple[int, int], value: str) -> SpeechMark:
        mark = SpeechMark(self.count, kind, self.samples, end_sample, span, value)
        self.count += 1
        return mark

    def sentence(self, span: tuple[int, int], value: str, chunks: Iterable[np.ndarray]) -> Iterator:
        """The sentence's mark, its chunks (counted), then its MarkEnd."""
        mark = self._mark(SENTENCE, None, span, value)
        yield mark
        for chunk in chunks:
            self.samples += chunk.size
            yield chunk
        yield MarkEnd(mark.index, self.samples)

    def point(self, name: str, span: tuple[int, int]) -> SpeechMark:
        """An SSML <mark>: a point between the audio before and after."""
        return self._mark(MARK, self.samples, span, name)

    def pause(self, samples: int, span: tuple[int, int]) -> SpeechMark:
        """An SSML <break> of `samples` samples of silence, which come next (counted here)."""
        mark = self._mark(BREAK, self.samples + samples, span, f"{samples * 1000 / SAMPLE_RATE:g}ms")
        self.samples += samples
        return mark


def source_value(text: str, span: tuple[int, int], ssml: bool) -> str:
    """A sentence mark's value: the request text of its span (SSML: tags dropped, entities read, white space
    made single spaces)."""
    value = text[span[0]:span[1]]
    return " ".join(html.unescape(_TAG.sub(" ", value)).split()) if ssml else value


def is_mark_event(item: object) -> bool:
    return isinstance(item, (SpeechMark, MarkEnd))


# ---- the JSON side: what clients and the gateway do with the events ----------------------------------------------

class MarkList:
    """Mark events (JSON dicts) in the order they came -> the complete marks (`marks`), each sentence's end_ms
    filled in by its mark_end. Complete marks (a whole answer's) pass through unchanged."""

    def __init__(self):
        self.marks: list[dict] = []
        self._open: dict[int, dict] = {}  # index -> a sentence mark waiting for its mark_end

    def add(self, event: dict) -> None:
        if event.get("type") == MARK_END:
            mark = self._open.pop(event["index"], None)
            if mark is not None:
                mark["end_ms"] = event["end_ms"]
            return
        mark = dict(event)
        self.marks.append(mark)
        if mark.get("end_ms") is None:
            self._open[mark["index"]] = mark

    def extend(self, events: Iterable[dict]) -> MarkList:
        for event in events:
            self.add(event)
        return self


def complete_marks(events: Iterable[dict]) -> list[dict]:
    """The complete marks of a request's events."""
    return MarkList().extend(events).marks


def shifted(event: dict, samples: int, chars: int, indexes: int) -> dict:
    """An event of one part of a longer answer (a WebSocket session's segment) in the whole answer's terms: its
    times after `samples` samples, its span after `chars` characters, its index after `indexes` marks."""
    moved = dict(event, index=event["index"] + indexes)
    for key in ("start_ms", "end_ms"):
        if moved.get(key) is not None:
            moved[key] = ms(samples + samples_of(moved[key]))
    for key in ("start", "end"):
        if key in moved:
            moved[key] += chars
    return moved


def mark_message(event: dict, prefix: str = "") -> dict:
    """An event as a message of a stream that carries other messages too (the gateway's WebSocket: no prefix;
    server-sent events: "speech."): {"type": "mark", "mark": {...}} or {"type": "mark_end", "index", "end_ms"}."""
    if event.get("type") == MARK_END:
        return {**event, "type": prefix + MARK_END}
    return {"type": prefix + "mark", "mark": event}


def event_of(message: dict, prefix: str = "") -> dict | None:
    """The mark event of a `mark_message` (None for any other message)."""
    kind = message.get("type")
    if kind == prefix + "mark":
        return message.get("mark")
    if kind == prefix + MARK_END:
        return {**message, "type": MARK_END}
    return None
