"""The gateway's field names, in one place: the accepted aliases, and each API's names for the request fields.

Aliases (`FIELD_ALIASES`): an older name maps to the name the README documents (glossary: a registered voice
is named by `voice_id`). /v1/tts and the WebSocket start message both resolve aliases here. The OpenAI route
is not aliased: `voice` is the OpenAI API's own field.

`Fields`: what an API calls each field of the wire request (`wire.names.INPUT_FIELDS`: `text`, `voice_id`,
`audio`, ...), so that an error the library raises, naming a Triton input, names the field of the API that
was called (`text` on /v1/tts, `input` on the OpenAI route, ...). A field no API renames keeps its name
(seed, speed, chunk_*).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.wire.names import INPUT_FIELDS


FIELD_ALIASES = {"voice": "voice_id"}  # alias -> documented field (/v1/tts, the WebSocket's start message)
SOURCE_ALIASES = {"audio": "source_audio"}  # /v1/vc and the WebSocket's vc message: the recording to speak again


def resolve_aliases(body: dict, aliases: dict[str, str] = FIELD_ALIASES) -> dict:
    """`body` with every alias renamed to its documented field; giving both is a 400 naming the alias."""
    resolved = dict(body)
    for alias, name in aliases.items():
        if alias in resolved:
            if name in resolved:
                raise InvalidInput(alias, f"give {name} (or its alias {alias}), not both")
            resolved[name] = resolved.pop(alias)
    return resolved


@dataclass(frozen=True)
class Fields:
    """One API's names of the request fields (the defaults: /v1/tts, the WebSocket and /v1/vc)."""

    text: str = "text"
    voice_id: str = "voice_id"
    audio: str = "prompt_audio"  # the voice's prompt recording
    prompt_text: str = "prompt_text"
    instruct_text: str = "instruct"
    source: str = "source_audio"  # the recording a conversion speaks again

    def sent(self, body: dict, aliases: dict[str, str] = SOURCE_ALIASES) -> Fields:
        """These names, each aliased field named as `body` named it (an error names the field as it was sent)."""
        return replace(self, **{f.name: alias for f in fields(self) for alias, name in aliases.items()
                                if getattr(self, f.name) == name and alias in body})

    def name(self, field: str | None) -> str | None:
        """The API's name of request field `field`."""
        return getattr(self, field) if field in {f.name for f in fields(self)} else field

    def of_input(self, input_name: str | None) -> str | None:
        """The API's field behind a Triton input named in an error."""
        return self.name(INPUT_FIELDS.get(input_name, input_name))

    @contextmanager
    def named(self) -> Iterator[None]:
        """The library's checks inside: their errors (naming Triton inputs) as this API's 400s."""
        try:
            yield
        except InvalidInput as exc:
            raise InvalidInput(self.of_input(exc.field) or "request", exc.problem) from None


TTS_FIELDS = Fields()
OPENAI_FIELDS = Fields(text="input", voice_id="voice", instruct_text="instructions")
REGISTER_FIELDS = Fields(voice_id="id", audio="audio", prompt_text="text")  # prompt_text: "prompt_text" if sent so
