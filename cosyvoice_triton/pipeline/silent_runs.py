"""Long runs of silence tokens do not reach token2wav (the official CosyVoice3 `llm_job`).

A family may name speech tokens that are silence or breath (`ModelFamily.silent_tokens`: CosyVoice3's 11
FSQ codes). Once more than `max_silent_run` (5) of them come in a row, the rest of the run is dropped before
the flow; the LLM has already fed them back, so its decoding is unchanged. An empty set keeps every token
(CosyVoice2).
"""
from __future__ import annotations

from ..family import ModelFamily


class SilentRuns:
    """The filter of one LLM stream's tokens (keeps the length of the current silent run)."""

    def __init__(self, family: ModelFamily):
        self.silent = family.silent_tokens
        self.max_run = family.max_silent_run
        self.run = 0  # silent tokens in a row so far, dropped ones included

    def keep(self, tokens: list[int]) -> list[int]:
        """The tokens that go on to token2wav, in order."""
        if not self.silent:
            return tokens
        kept = []
        for token in tokens:
            self.run = self.run + 1 if token in self.silent else 0
            if self.run <= self.max_run:
                kept.append(token)
        return kept
