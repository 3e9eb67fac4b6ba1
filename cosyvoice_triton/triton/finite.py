"""NaN / Inf checks at the model boundaries that take floating-point tensors from a request.

Each Triton model that reads float inputs (speaker_embedding and audio_tokenizer: `wav16k`; token2wav:
a stream's first chunk carries the prompt mel and embedding) calls these on what it parsed, so a request
with a NaN is refused with INVALID_ARG naming the input instead of being computed into NaN audio or
poisoning a batch it shares with other streams.
"""
from __future__ import annotations

import numpy as np

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.wire.names import EMBEDDING, PROMPT_MEL


def check_finite(field: str, values):
    """`values` (a numpy array or a torch tensor) unless it holds a NaN or an infinity (InvalidInput naming
    `field`)."""
    finite = bool(values.isfinite().all()) if hasattr(values, "isfinite") else bool(np.isfinite(values).all())
    if not finite:
        raise InvalidInput(field, "contains NaN or infinite values")
    return values


def check_chunk_finite(chunk):
    """`chunk`, a parsed token2wav request (ChunkRequest or StreamCancel), if its prompt (first chunk of a
    stream) is finite; later chunks carry only token ids."""
    if getattr(chunk, "prompt", None) is not None:  # a StreamCancel has none
        check_finite(PROMPT_MEL, chunk.prompt.mel)
        check_finite(EMBEDDING, chunk.prompt.embedding)
    return chunk
