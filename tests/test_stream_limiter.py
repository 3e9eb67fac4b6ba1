"""The gateway's stream limit counts streams, not requests waiting to be admitted (gateway/auth.py)."""
from __future__ import annotations

import pytest
from cosyvoice_triton.gateway.auth import KEYLESS, StreamLimiter, slot_set_aside
from cosyvoice_triton.errors import TooManyStreams


def test_a_request_waiting_for_admission_leaves_its_slot_to_others():
    limiter = StreamLimiter(1, keyless_limit=1)
    with limiter.slot(KEYLESS):
        with pytest.raises(TooManyStreams):
            with limiter.slot(KEYLESS):
                pass
        with slot_set_aside():  # waiting for a fresh scrape: not a stream yet
            assert limiter.active(KEYLESS) == 0
            with limiter.slot(KEYLESS):  # another request streams meanwhile
                assert limiter.active(KEYLESS) == 1
        assert limiter.active(KEYLESS) == 1  # taken back after the wait
    assert limiter.active(KEYLESS) == 0


def test_setting_aside_without_a_slot_changes_nothing():
    limiter = StreamLimiter(2)
    with slot_set_aside():
        assert limiter.active(KEYLESS) == 0
    with limiter.slot("k"):
        pass
    with slot_set_aside():
        assert limiter.active("k") == 0
