"""Accepted aliases of the gateway's JSON fields: the one place where an older name maps to the name the
README documents (glossary: a registered voice is named by `voice_id`). /v1/tts and the WebSocket start
message both resolve aliases here. The OpenAI route is not aliased: `voice` is the OpenAI API's own field.
"""
from __future__ import annotations

from .errors import BadRequest

FIELD_ALIASES = {"voice": "voice_id"}  # alias -> documented field


def resolve_aliases(body: dict) -> dict:
    """`body` with every alias renamed to its documented field; giving both is a 400 naming the alias."""
    resolved = dict(body)
    for alias, name in FIELD_ALIASES.items():
        if alias in resolved:
            if name in resolved:
                raise BadRequest(alias, f"give {name} (or its alias {alias}), not both")
            resolved[name] = resolved.pop(alias)
    return resolved
