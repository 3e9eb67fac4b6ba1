"""Which vocoder stream a vocoder gets: the one place where token2wav tells the families' vocoders apart.

CosyVoice2's HiFT streams with a mel and source cache and a cross-fade, its noise drawn from the stream's
seed (`VocoderStream`); CosyVoice3's causal HiFT on a window of the mel so far, with its fixed noise
(`CausalVocoderStream`). Both take `prepare` / `vocode` / `commit` (and `push`, `check_chunk`, `close`), so
`Token2Wav` and `Token2WavScheduler` run either without asking which.
"""
from __future__ import annotations

from ..models.causal_hift import CausalHiFTGenerator
from ..models.hift import HiFTGenerator
from .causal_vocoder_stream import CausalVocoderStream
from .vocoder_stream import VocoderStream

AnyVocoderStream = VocoderStream | CausalVocoderStream

STREAMS: dict[type, type[AnyVocoderStream]] = {HiFTGenerator: VocoderStream, CausalHiFTGenerator: CausalVocoderStream}


def vocoder_stream_class(hift: HiFTGenerator | CausalHiFTGenerator) -> type[AnyVocoderStream]:
    """The stream class of `hift` (an engine's HiFT is a subclass of its family's)."""
    for cls in type(hift).__mro__:
        if cls in STREAMS:
            return STREAMS[cls]
    raise TypeError(f"{type(hift).__name__} is the vocoder of no model family")
