"""One token2wav stream fed from a growing list of speech tokens: what a TTS sentence (`Pipeline`) and a
voice-conversion piece (`VoiceConverter`) share.

The first chunk carries the voice's flow prompt and the vocoder seed; each chunk carries only the tokens
not sent before; every chunk's audio is added to the request's `Playback`, whose lead an adaptive chunk
policy reads. A stream left before its final chunk (an error, a cancel, a closed generator) is cancelled
in token2wav, so its state is freed at once.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..audio_out import SAMPLE_RATE
from ..errors import Cancelled
from ..messages import ChunkRequest, FlowPrompt
from .chunk_policy import ChunkSchedule
from .playback import Playback
from .stages import Token2WavStage


@dataclass
class ChunkSender:
    """Sends the chunks of token2wav stream `stream_id`: those the schedule makes due (`due`), then the final
    one (`finish`); `close()` cancels the stream if it was opened and not finished."""

    token2wav: Token2WavStage
    stream_id: str
    prompt: FlowPrompt  # sent with the first chunk
    vocoder_seed: int
    speed: float
    playback: Playback  # the request's listener, across its sentences or pieces
    sent: int = 0  # tokens already handed to token2wav
    opened: bool = False
    finished: bool = False

    def due(self, tokens: list[int], schedule: ChunkSchedule,
            is_cancelled: Callable[[], bool]) -> Iterator[np.ndarray]:
        """The audio of every chunk that `schedule` makes due with `tokens` known, in order."""
        while schedule.due(len(tokens), lead := self.playback.lead(time.monotonic())):
            _, end = schedule.advance(len(tokens), lead)
            yield self._send(tokens, end, finalize=False)
            if is_cancelled():
                raise Cancelled("the client cancelled the request")

    def finish(self, tokens: list[int]) -> np.ndarray:
        """The final chunk's audio: every token not sent yet; the stream's state is then freed."""
        audio = self._send(tokens, len(tokens), finalize=True)
        self.finished = True
        return audio

    def close(self) -> None:
        """Cancel the stream in token2wav if it was opened and not finished."""
        if self.opened and not self.finished:
            self.token2wav.cancel(self.stream_id)

    def _send(self, tokens: list[int], end: int, finalize: bool) -> np.ndarray:
        chunk = ChunkRequest(stream_id=self.stream_id, tokens=tokens[self.sent:end], finalize=finalize,
                             prompt=None if self.opened else self.prompt, seed=self.vocoder_seed, speed=self.speed)
        self.opened, self.sent = True, end
        audio = self.token2wav.chunk(chunk)
        if audio.size:
            self.playback.add(time.monotonic(), audio.size / SAMPLE_RATE)
        return audio
