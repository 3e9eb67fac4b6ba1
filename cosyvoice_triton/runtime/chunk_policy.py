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

from ..messages import MIN_HOP_TOKENS, ChunkPolicy  # noqa: F401 - the message and its limit live there


class ChunkSchedule:
    """The hop sequence of one stream of `policy` (a `ChunkPolicy`) after a prompt of `prompt_tokens`."""

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
