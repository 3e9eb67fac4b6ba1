"""The rules a request's values meet, run where a request enters a process (the gateway's parse, a model's
tensor parse, the in-process API's entry) and nowhere after it. Each raises InvalidInput naming the field.

The rules of the library's own values (mode, seed, speed, sampling, chunk policy) are the types' in
`messages.py`; these are the ones a wire request adds: text, options as they arrive, one voice.
"""
from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import TEXT_MODES, ChunkPolicy, SamplingParams, is_int
from cosyvoice_triton.wire.names import CHUNK_FIELDS, INT32_MAX, OPTION_TYPES, TARGET_TEXT, TEXT_MODE

DEFAULT_MAX_CHARS = 2000  # the longest request text (a server's --max-text-chars)
ALLOWED_CONTROLS = frozenset("\t\n\r")


def text_problem(text: str) -> str | None:
    """What makes `text` unusable as request text, or None: a lone surrogate (not valid Unicode, cannot
    be UTF-8 encoded) or a control character other than tab, newline and carriage return (terminal
    escapes, NUL, ...). Format characters such as zero-width joiners are allowed."""
    for position, char in enumerate(text):
        category = unicodedata.category(char)
        if category == "Cs":
            return f"contains a lone surrogate U+{ord(char):04X} at position {position} (not valid Unicode)"
        if category == "Cc" and char not in ALLOWED_CONTROLS:
            return f"contains the control character U+{ord(char):04X} at position {position}"
    return None


def check_clean_text(text: str, field: str) -> str:
    """`text` unless `text_problem` finds something (InvalidInput naming `field`)."""
    problem = text_problem(text)
    if problem:
        raise InvalidInput(field, problem)
    return text


def validate_text(text: object, field: str, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Return `text` if it is a non-blank string of at most `max_chars` characters, valid Unicode without
    control characters (`text_problem`)."""
    if not isinstance(text, str):
        raise InvalidInput(field, f"must be a string, got {type(text).__name__}")
    if not text.strip():
        raise InvalidInput(field, "must not be empty")
    if len(text) > max_chars:
        raise InvalidInput(field, f"is {len(text)} characters long; the limit is {max_chars}")
    return check_clean_text(text, field)


def check_optional_text(value: object, name: str) -> None:
    """None, or a string without control characters or lone surrogates; InvalidInput naming `name`."""
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidInput(name, f"must be a string, got {type(value).__name__}")
    check_clean_text(value, name)


def check_text_mode(text_mode: object) -> None:
    if text_mode not in TEXT_MODES:
        raise InvalidInput(TEXT_MODE, f"must be one of {', '.join(TEXT_MODES)}, got {text_mode!r}")


def check_text_piece(text: str, max_chars: int) -> None:
    """A bistream piece: any text (even none) of at most `max_chars` characters."""
    if len(text) > max_chars:
        raise InvalidInput(TARGET_TEXT, f"a text piece takes at most {max_chars} characters, got {len(text)}")


def check_one_voice(voice_id: object, audio: object, id_field: str, audio_field: str, required: bool = True) -> None:
    """A request names its voice by a registered id or by a prompt recording, never both; `required`: one of
    the two (else the caller has a default voice)."""
    if voice_id is not None and audio is not None:
        raise InvalidInput(id_field, f"give {id_field} or {audio_field}, not both")
    if required and voice_id is None and audio is None:
        raise InvalidInput(audio_field, f"a voice is required: {id_field} or {audio_field}")


def check_sampling(overrides: Mapping[str, object]) -> None:
    """Sampling overrides (top_p, top_k, win_size, tau_r: the values given) in their ranges."""
    replace(SamplingParams(), **overrides).validate()


def check_chunk_overrides(overrides: Mapping[str, object], policy: ChunkPolicy = ChunkPolicy()) -> None:
    """Chunk-policy overrides (ChunkPolicy.with_overrides' keywords): each a value that fits its tensor, and
    `policy` with them valid (the gateway checks against the default policy, a server against its own)."""
    for name, attr in CHUNK_FIELDS.items():
        value, kind = overrides.get(attr), OPTION_TYPES[name]
        if value is None:
            continue
        if kind is str and not isinstance(value, str):
            raise InvalidInput(name, f"must be a string, got {type(value).__name__}")
        if kind is np.int32 and not is_int(value):
            raise InvalidInput(name, f"must be an integer, got {type(value).__name__}")
        if kind is np.int32 and value > INT32_MAX:  # ChunkPolicy checks the lower bounds
            raise InvalidInput(name, f"must be at most {INT32_MAX}, got {value}")
        if kind is np.float32 and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InvalidInput(name, f"must be a number, got {type(value).__name__}")
    policy.with_overrides(**overrides)
