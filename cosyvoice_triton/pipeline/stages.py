"""The stages a pipeline is built from: what the pipeline and voice conversion need of an LLM and of token2wav.

Implementations: `local_stages` (the schedulers or the reference code in this process), `triton.bls` (the llm and
token2wav Triton models over BLS) and `triton.remote_token2wav` (token2wav servers over gRPC).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from ..messages import ChunkRequest, LLMRequest


class TokenStream(Protocol):
    def __iter__(self) -> Iterator[list[int]]: ...

    def cancel(self) -> None: ...

    def append_text(self, tokens: list[int], end: bool = False) -> None:
        """Bistream streams only: more text for the live stream."""


class LLMStage(Protocol):
    def stream(self, request: LLMRequest) -> TokenStream: ...


class Token2WavStage(Protocol):
    def chunk(self, chunk: ChunkRequest) -> np.ndarray: ...

    def cancel(self, stream_id: str) -> None: ...
