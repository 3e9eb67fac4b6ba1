"""When a streaming synthesis may turn its speech tokens into audio.

The flow model attends in chunks of `chunk_tokens` (25) tokens counted from the start of
prompt + generated tokens, and needs `lookahead` (3) tokens of right context. The official schedule
therefore pads the first hop so that it ends on a chunk boundary of the prompt + token sequence
(hop = 25 + pad, pad = ceil(P / 25) * 25 - P for a prompt of P tokens), and then grows the hop
geometrically (x2) up to 100 tokens: small first chunk for latency, larger later chunks for
throughput and fewer re-computations of the flow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import InvalidInput

MIN_HOP_TOKENS = 4


@dataclass(frozen=True)
class ChunkPolicy:
    first_hop: int = 25  # tokens in the first chunk, before the prompt alignment pad
    hop_scale: float = 2.0  # each later hop is the previous one times this
    max_hop: int = 100  # hops never grow beyond this many tokens
    lookahead: int = 3  # right-context tokens the flow's pre-lookahead layer needs
    align_to_chunk: bool = True  # pad the first hop so it ends on a flow attention chunk boundary
    chunk_tokens: int = 25  # the flow's attention chunk, in tokens (yaml: chunk_size)

    def validate(self) -> "ChunkPolicy":
        if self.first_hop < MIN_HOP_TOKENS:
            # The vocoder holds back 8 mel frames (4 tokens) of every non-final chunk for its cross-fade.
            raise InvalidInput("chunk_first_hop", f"must be >= {MIN_HOP_TOKENS}, got {self.first_hop}")
        if not 1.0 <= self.hop_scale <= 16.0:
            raise InvalidInput("chunk_hop_scale", f"must be in [1, 16], got {self.hop_scale}")
        if self.max_hop < self.first_hop:
            raise InvalidInput("chunk_max_hop", f"must be >= first hop {self.first_hop}, got {self.max_hop}")
        if self.lookahead < 0:
            raise InvalidInput("chunk_lookahead", f"must be >= 0, got {self.lookahead}")
        return self

    def with_overrides(self, **overrides) -> "ChunkPolicy":
        """A copy with per-request overrides (None values are ignored), validated."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **given).validate()

    def schedule(self, prompt_tokens: int) -> "ChunkSchedule":
        return ChunkSchedule(self, prompt_tokens)


class ChunkSchedule:
    """The hop sequence of one stream: call `next_end` to know how many tokens the next chunk needs."""

    def __init__(self, policy: ChunkPolicy, prompt_tokens: int):
        self.policy = policy
        pad = 0
        if policy.align_to_chunk:
            chunk = policy.chunk_tokens
            pad = math.ceil(prompt_tokens / chunk) * chunk - prompt_tokens
        self.offset = 0  # tokens already turned into audio
        self._hop = policy.first_hop
        self._first_pad = pad

    @property
    def hop(self) -> int:
        """Tokens the next non-final chunk will emit."""
        return self._hop + (self._first_pad if self.offset == 0 else 0)

    @property
    def needed(self) -> int:
        """Total generated tokens needed before the next non-final chunk can run."""
        return self.offset + self.hop + self.policy.lookahead

    def advance(self) -> tuple[int, int]:
        """Consume one non-final chunk. Returns (token_offset, token_end) of the flow call."""
        start, end = self.offset, self.needed
        self.offset += self.hop
        self._hop = min(self.policy.max_hop, int(self._hop * self.policy.hop_scale))
        return start, end
