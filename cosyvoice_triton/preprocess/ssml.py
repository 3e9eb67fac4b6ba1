"""SSML (a documented subset, docs/api/ssml.md) -> the parts of a synthesis, in order.

`parse_ssml` reads a whole `<speak>` document before any audio is made, so bad SSML is an InvalidInput naming
the request's text field (a 400 at the gateway, INVALID_ARG at Triton), never partial audio. The parts:

  Speech  a run of text spoken with one voice, speed and language; a run ends at every <p>/<s> edge,
          <break>, <mark> and every change of voice, rate or language (the text preprocessor splits sentences
          inside a run, never across runs)
  Pause   <break>: silence of exactly `samples` samples at 24 kHz
  Mark    <mark name>: a named point between parts (no audio)

Each part keeps `span`, the (start, end) character offsets of its source in the request text. Inline elements
change the text only: <emphasis> wraps it in CosyVoice2's own <strong>...</strong>, <sub alias> speaks the
alias, <say-as> expands the content to words (`expand_say_as`); CosyVoice2's own tags (<strong>, <laughter> as
elements, [breath] and the other bracket tags as text) stay in the text as they are.

The parser is expat with no DTD at all: a DOCTYPE or entity declaration is refused (so no entity expansion, no
external entity is ever read), and undefined entities are not well-formed.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from xml.parsers import expat

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import MAX_SPEED, MIN_SPEED, SAMPLE_RATE
MAX_PARTS = 200  # parts (speech runs, breaks, marks) in one document
MAX_BREAK_S = 10.0  # the longest <break>
BREAK_STRENGTHS = {"none": 0.0, "x-weak": 0.1, "weak": 0.25, "medium": 0.5, "strong": 0.75, "x-strong": 1.0}
RATES = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "fast": 1.25, "x-fast": 1.5}
SAY_AS = ("characters", "spell-out", "cardinal", "ordinal", "digits", "date", "time", "telephone")
EMPHASIS_LEVELS = {"strong": True, "moderate": True, "reduced": False, "none": False}  # level -> wrapped in <strong>

_LANG = re.compile(r"^[A-Za-z]{2,8}(-[A-Za-z0-9]{1,8})*$")
_BREAK_TIME = re.compile(r"^(\d+(?:\.\d+)?)(ms|s)$")
_PERCENT = re.compile(r"^(\d+(?:\.\d+)?)%$")
_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")
_INTEGER = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+$|^[+-]?\d+$")

# element -> the attributes it may carry ("xmlns:*" too on speak)
ATTRIBUTES = {
    "speak": {"version", "xmlns", "xml:lang"}, "p": {"xml:lang"}, "s": {"xml:lang"},
    "break": {"time", "strength"}, "prosody": {"rate"}, "emphasis": {"level"}, "sub": {"alias"},
    "say-as": {"interpret-as", "format"}, "voice": {"name"}, "lang": {"xml:lang"}, "mark": {"name"},
    "strong": set(), "laughter": set(),  # CosyVoice2's own tags, kept in the text as they are
}
REQUIRED = {"sub": "alias", "say-as": "interpret-as", "voice": "name", "lang": "xml:lang", "mark": "name"}
INLINE = {"emphasis", "sub", "say-as", "strong", "laughter"}  # change the text only: no run ends at them
TEXT_ONLY = {"sub", "say-as"}  # take text, no elements


@dataclass(frozen=True)
class Speech:
    text: str  # what to speak: the preprocessor normalizes and splits it
    span: tuple[int, int]  # characters of the request text it came from
    speed: float = 1.0  # product of the enclosing <prosody rate>s: times the request's speed
    voice_id: str | None = None  # <voice name>; None: the request's voice
    lang: str | None = None  # <lang>/xml:lang; None: detected from the text


@dataclass(frozen=True)
class Pause:
    samples: int  # of silence at SAMPLE_RATE: round(seconds * 24000)
    span: tuple[int, int]


@dataclass(frozen=True)
class Mark:
    name: str
    span: tuple[int, int]


Part = Speech | Pause | Mark


def is_ssml(text: object, text_type: str | None) -> bool:
    """Whether a request's text is SSML: text_type "ssml", or none given and the text starts with <speak."""
    if text_type is not None:
        return text_type == "ssml"
    return isinstance(text, str) and text.lstrip().startswith("<speak")


def spoken_text(parts: list[Part]) -> str:
    """The text of every Speech part, one run after another (what the length limit counts)."""
    return " ".join(p.text for p in parts if isinstance(p, Speech))


def parse_ssml(text: str, field: str = "text", say_as=None) -> list[Part]:
    """The parts of an SSML document. A text that does not start with <speak (or <?xml) is read as the content of
    one <speak>. `say_as(kind, content, lang) -> words` expands <say-as> (`expand_say_as`; None: the content as it
    is, e.g. a gateway that only checks the document). InvalidInput naming `field` for any problem."""
    body = text.lstrip()
    wrapped = not (body.startswith("<speak") or body.startswith("<?xml"))
    document = f"<speak>{text}</speak>" if wrapped else text
    return _Parser(document, field, say_as, shift=len("<speak>") if wrapped else 0, length=len(text)).parse()


@dataclass(frozen=True)
class _Scope:
    """What an open element means for the text inside it."""

    name: str
    speed: float = 1.0
    voice_id: str | None = None
    lang: str | None = None
    detail: object = None  # <say-as>: its kind; <emphasis>: whether wrapped; <mark>: (name, start)


class _Parser:
    def __init__(self, document: str, field: str, say_as, shift: int, length: int):
        self.document, self.field, self.say_as = document, field, say_as
        self.shift, self.length = shift, length  # wrapped text: spans count from the request text's start
        self.data = document.encode("utf-8")
        starts, at = [], 0  # the byte offset of each character, for expat's byte positions
        for char in document:
            starts.append(at)
            at += len(char.encode("utf-8"))
        self.starts = starts + [at]
        self.parts: list[Part] = []
        self.scopes: list[_Scope] = []
        self.run: list[str] = []  # text of the open run
        self.run_start: int | None = None
        self.captured: list[str] | None = None  # the content of an open <say-as>
        self.fallback_lang = "zh" if re.search(r"[\u4e00-\u9fff]", document) else "en"

    # ---- expat -------------------------------------------------------------------------------------------------
    def parse(self) -> list[Part]:
        parser = expat.ParserCreate("utf-8")
        parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
        parser.StartDoctypeDeclHandler = self._refuse_dtd
        parser.EntityDeclHandler = self._refuse_entity
        parser.ExternalEntityRefHandler = self._refuse_entity
        parser.StartElementHandler = self._start
        parser.EndElementHandler = self._end
        parser.CharacterDataHandler = self._text
        parser.buffer_text = False  # each piece of text at its own position (spans)
        self.parser = parser
        try:
            parser.Parse(self.data, True)
        except expat.ExpatError as exc:
            raise self.error(f"is not well-formed SSML: {expat.ErrorString(exc.code)} at line {exc.lineno}, "
                             f"column {exc.offset}") from None
        if not any(isinstance(p, (Speech, Pause)) for p in self.parts):
            raise self.error("the SSML document has nothing to speak")
        return self.parts

    def _refuse_dtd(self, *args) -> None:
        raise self.error("SSML: a DOCTYPE is not allowed (no DTD, no entity declarations)")

    def _refuse_entity(self, *args) -> None:
        raise self.error("SSML: entity declarations and external entities are not allowed")

    def error(self, problem: str) -> InvalidInput:
        return InvalidInput(self.field, problem)

    def position(self) -> int:
        """The current event's character offset in the request text."""
        char = bisect.bisect_left(self.starts, self.parser.CurrentByteIndex)
        return min(max(char - self.shift, 0), self.length)

    def tag_end(self) -> int:
        """The offset just past the tag the current event is at."""
        char = bisect.bisect_left(self.starts, self.parser.CurrentByteIndex)
        return min(max(self.document.find(">", char) + 1 - self.shift, 0), self.length)

    # ---- elements ----------------------------------------------------------------------------------------------
    def _start(self, name: str, attrs: dict[str, str]) -> None:
        self.check_element(name, attrs)
        outer = self.scopes[-1] if self.scopes else _Scope("")
        if outer.name in TEXT_ONLY:
            raise self.error(f"SSML <{outer.name}>: takes text only, got <{name}>")
        if name not in INLINE and any(s.name in INLINE for s in self.scopes):
            inline = next(s.name for s in reversed(self.scopes) if s.name in INLINE)
            raise self.error(f"SSML <{name}>: cannot be inside <{inline}> (which changes text only)")
        if not self.scopes and name != "speak":
            raise self.error(f"SSML: the root element must be <speak>, got <{name}>")
        if self.scopes and name == "speak":
            raise self.error("SSML <speak>: only the root element can be <speak>")
        if name not in INLINE:
            self.end_run(outer)
        elif self.run_start is None:
            self.run_start = self.position()  # the run begins at this element
        lang = attrs.get("xml:lang", outer.lang)
        speed, voice_id, detail = outer.speed, attrs.get("name") if name == "voice" else outer.voice_id, None
        if name == "prosody" and "rate" in attrs:
            speed = self.rate(attrs["rate"], outer.speed)
        elif name == "break":
            self.add(Pause(self.break_samples(attrs), (self.position(), self.tag_end())))
        elif name == "mark":  # an empty tag <mark/> ends here; <mark></mark> at its end tag
            end = self.tag_end()
            detail = (attrs["name"], self.position(), end if self.document[end + self.shift - 2] == "/" else None)
        elif name == "emphasis":
            detail = EMPHASIS_LEVELS[attrs.get("level", "moderate")]
            if detail:
                self.add_text("<strong>")
        elif name in ("strong", "laughter"):
            self.add_text(f"<{name}>")
        elif name == "sub":
            self.add_text(attrs["alias"])
        elif name == "say-as":
            self.captured, detail = [], attrs["interpret-as"]
        self.scopes.append(_Scope(name, speed, voice_id, lang, detail))

    def _end(self, name: str) -> None:
        scope = self.scopes.pop()
        if name == "mark":
            mark_name, start, end = scope.detail
            self.add(Mark(mark_name, (start, end if end is not None else self.tag_end())))
        elif name == "emphasis" and scope.detail:
            self.add_text("</strong>")
        elif name in ("strong", "laughter"):
            self.add_text(f"</{name}>")
        elif name == "say-as":
            content, self.captured = "".join(self.captured), None
            lang = language(scope.lang) if scope.lang else self.fallback_lang
            self.add_text(self.say_as(scope.detail, content, lang) if self.say_as else content)
        if name not in INLINE:
            self.end_run(scope)

    def _text(self, data: str) -> None:
        scope = self.scopes[-1] if self.scopes else None
        if scope is None or scope.name == "sub":
            return  # <sub>: the alias is spoken instead
        if self.captured is not None:
            self.captured.append(data)
            return
        if scope.name in ("break", "mark") and data.strip():
            raise self.error(f"SSML <{scope.name}>: must be empty, got text {data.strip()[:20]!r}")
        self.add_text(data)

    # ---- checks ------------------------------------------------------------------------------------------------
    def check_element(self, name: str, attrs: dict[str, str]) -> None:
        if name not in ATTRIBUTES:
            raise self.error(f"SSML <{name}>: is not a supported element (supported: {', '.join(ATTRIBUTES)})")
        for attr in attrs:
            if attr not in ATTRIBUTES[name] and not (name == "speak" and attr.startswith("xmlns:")):
                allowed = ", ".join(sorted(ATTRIBUTES[name])) or "none"
                raise self.error(f"SSML <{name}>: has no attribute {attr!r} (attributes: {allowed})")
        if name in REQUIRED and not attrs.get(REQUIRED[name], "").strip():
            raise self.error(f"SSML <{name}>: the attribute {REQUIRED[name]!r} is required")
        if "xml:lang" in attrs and not _LANG.match(attrs["xml:lang"]):
            raise self.error(f"SSML <{name}>: xml:lang must be a language tag such as en-US, got {attrs['xml:lang']!r}")
        if name == "say-as":
            if attrs["interpret-as"] not in SAY_AS:
                raise self.error(f"SSML <say-as>: interpret-as must be one of {', '.join(SAY_AS)}, "
                                 f"got {attrs['interpret-as']!r}")
        if name == "emphasis" and attrs.get("level", "moderate") not in EMPHASIS_LEVELS:
            raise self.error(f"SSML <emphasis>: level must be one of {', '.join(EMPHASIS_LEVELS)}, "
                             f"got {attrs['level']!r}")

    def break_samples(self, attrs: dict[str, str]) -> int:
        """<break time> ("500ms", "1.5s"; it wins over strength) or <break strength> (default medium)."""
        if "time" in attrs:
            match = _BREAK_TIME.match(attrs["time"].strip())
            if not match:
                raise self.error(f"SSML <break>: time must be like 500ms or 1.5s, got {attrs['time']!r}")
            seconds = float(match.group(1)) / (1000.0 if match.group(2) == "ms" else 1.0)
        else:
            strength = attrs.get("strength", "medium")
            if strength not in BREAK_STRENGTHS:
                raise self.error(f"SSML <break>: strength must be one of {', '.join(BREAK_STRENGTHS)}, "
                                 f"got {strength!r}")
            seconds = BREAK_STRENGTHS[strength]
        if seconds > MAX_BREAK_S:
            raise self.error(f"SSML <break>: time {attrs['time']!r} is over the {MAX_BREAK_S:g} s limit")
        return round(seconds * SAMPLE_RATE)

    def rate(self, value: str, outer: float) -> float:
        """<prosody rate>: a name, a percentage or a factor, times the enclosing rate (nested prosody multiplies)."""
        value = value.strip()
        if value in RATES:
            factor = RATES[value]
        elif _PERCENT.match(value):
            factor = float(value[:-1]) / 100.0
        elif _NUMBER.match(value):
            factor = float(value)
        else:
            raise self.error(f"SSML <prosody>: rate must be one of {', '.join(RATES)}, a percentage (80%) or a "
                             f"factor (1.2), got {value!r}")
        speed = outer * factor
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise self.error(f"SSML <prosody>: rate {value!r} gives speed {speed:g}, outside {MIN_SPEED} .. {MAX_SPEED}")
        return speed

    # ---- parts -------------------------------------------------------------------------------------------------
    def add(self, part: Part) -> None:
        if len(self.parts) >= MAX_PARTS:
            raise self.error(f"SSML: more than {MAX_PARTS} parts (speech runs, breaks and marks)")
        self.parts.append(part)

    def add_text(self, text: str) -> None:
        if self.run_start is None:
            self.run_start = self.position()
        self.run.append(text)

    def end_run(self, scope: _Scope) -> None:
        """The open run of text, if it has any, as one Speech part in `scope` (the element it was written in)."""
        text = " ".join("".join(self.run).split())  # XML white space: one space
        start, self.run, self.run_start = self.run_start, [], None
        if text:
            self.add(Speech(text, (start, self.position()), scope.speed, scope.voice_id, scope.lang))


# ---- <say-as> -------------------------------------------------------------------------------------------------

_EN_DIGITS = "zero one two three four five six seven eight nine".split()
_ZH_DIGITS = "零一二三四五六七八九"
_ORDINAL_ENDINGS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                    "nine": "ninth", "twelve": "twelfth"}


def language(tag: str) -> str:
    """The normalization language of a language tag: "zh" for Chinese (zh, cmn, yue), else "en"."""
    return "zh" if tag.split("-")[0].lower() in ("zh", "cmn", "yue") else "en"


def expand_say_as(kind: str, content: str, lang: str) -> str:
    """<say-as interpret-as=kind> content as words in `lang` ("en" or "zh"). characters/spell-out and digits are
    read one by one here; cardinal and ordinal integers by the English number words (`spell_out_integer`) or
    wetext's Chinese; date, time and telephone by wetext. Content a case cannot read stays as it is (the text
    preprocessor normalizes it with the rest)."""
    from cosyvoice_triton.preprocess.text import spell_out_integer, wetext_normalizers

    text = content.strip()
    digits = _ZH_DIGITS if lang == "zh" else _EN_DIGITS
    if kind in ("characters", "spell-out", "digits"):
        return ("" if lang == "zh" else " ").join(digits[int(c)] if c.isascii() and c.isdigit() else c for c in text if not c.isspace())
    zh, en = wetext_normalizers()
    if kind in ("cardinal", "ordinal") and _INTEGER.match(text):
        number = text.replace(",", "").lstrip("+")
        sign, number = ("minus " if number.startswith("-") else ""), number.lstrip("-")
        if lang == "zh":
            words = ("负" if sign else "") + zh.normalize(number)
            return "第" + words if kind == "ordinal" else words
        words = spell_out_integer(number)
        return sign + (ordinal_words(words) if kind == "ordinal" else words)
    if kind in ("date", "time", "telephone"):
        return (zh if lang == "zh" else en).normalize(text)
    return content


def ordinal_words(words: str) -> str:
    """'twenty-one' -> 'twenty-first', 'one hundred and twelve' -> 'one hundred and twelfth'."""
    head, sep, last = max(words.rpartition(" "), words.rpartition("-"), key=lambda p: len(p[0]))
    if last in _ORDINAL_ENDINGS:
        last = _ORDINAL_ENDINGS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + last
