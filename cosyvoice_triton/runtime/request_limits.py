"""What a synthesis request may ask for, with no model code behind it (the gateway checks requests with
these before any server sees them)."""
from __future__ import annotations

MODES = ("zero_shot", "cross_lingual", "instruct2")
SEED_LIMIT = 2**63  # request seeds are in [0, SEED_LIMIT)
