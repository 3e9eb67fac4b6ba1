"""The gateway's field aliases (gateway/fields.py): one table, used by /v1/tts and the WebSocket."""
import pytest

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.gateway.fields import FIELD_ALIASES, resolve_aliases


def test_an_alias_becomes_its_documented_field():
    assert FIELD_ALIASES == {"voice": "voice_id"}
    body = {"text": "Hi.", "voice": "default"}
    assert resolve_aliases(body) == {"text": "Hi.", "voice_id": "default"}
    assert body == {"text": "Hi.", "voice": "default"}  # the caller's dict is left as it was


def test_documented_fields_pass_unchanged():
    assert resolve_aliases({"voice_id": "me", "seed": 3}) == {"voice_id": "me", "seed": 3}


def test_alias_and_field_together_is_refused_naming_the_alias():
    with pytest.raises(InvalidInput) as caught:
        resolve_aliases({"voice": "a", "voice_id": "b"})
    assert caught.value.field == "voice"
