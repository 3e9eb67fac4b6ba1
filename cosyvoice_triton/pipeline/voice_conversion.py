"""Voice conversion (the official `inference_vc`): a source recording spoken again in a target voice.

source (any rate) -> 16 kHz -> pieces of at most 30 s -> each piece's speech tokens (the family's speech
tokenizer, v2 or v3, as a prompt's are made) -> token2wav with the target voice's flow prompt (prompt tokens, prompt mel,
embedding) -> 24 kHz audio. No text and no LLM: the source's tokens take the place of generated ones.

Split rule (the S3 tokenizer takes at most 30 s): a source of d > 30 s is cut into n = ceil(d / 28 s) pieces;
each cut lies at the quietest 40 ms frame (one speech token, 640 samples at 16 kHz) within 1 s of the
equal-length cut, so every piece is at most 30 s and cuts fall in pauses where there are any. Piece i is its
own token2wav stream (streamed: the chunk schedule of a TTS sentence; not streamed: one full-attention flow
pass) with the vocoder seed of sentence i (`request.sentence_seeds`), and the pieces' audio follows in order.
The voice's prompt features are the stored ones (tokens and mel aligned as the zero-shot frontend makes them);
`speed` stretches the mel before HiFT as in synthesis (token2wav/speed.py).

The same `VoiceConverter` runs in-process (`local_converter`: the prompt encoder's tokenizer and the reference
token2wav) and inside the Triton `cosyvoice2` model (BLS calls to audio_tokenizer and token2wav), so both give
the same audio for the same seed.
"""
from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import Cancelled, InvalidInput
from ..messages import ConversionRequest, FlowPrompt
from ..preprocess.audio import check_samples, resample, to_mono
from .chunk_policy import ChunkSchedule
from .chunk_sender import ChunkSender
from .pipeline import flow_prompt_of
from .stages import Token2WavStage
from .playback import Playback
from .seeds import random_seed, sentence_seeds

TOKENIZER_RATE = 16000  # the S3 tokenizer's input rate
SAMPLES_PER_TOKEN = 640  # 16 kHz / 25 Hz
MAX_PIECE_SECONDS = 30.0  # the S3 tokenizer's limit (the official frontend asserts it)
TARGET_PIECE_SECONDS = 28.0  # nominal piece length of a split source
CUT_SEARCH_SECONDS = 1.0  # a cut moves at most this far from the equal-length cut, to the quietest frame
MIN_SOURCE_SECONDS = 0.2  # five speech tokens
MAX_SOURCE_SECONDS = 600.0  # ten minutes

Tokenizer = Callable[[np.ndarray], np.ndarray]  # (N,) float32 at 16 kHz -> (about N / 640,) int32 tokens


def validate_source_audio(samples: np.ndarray, sample_rate: int, field: str) -> None:
    """Raise InvalidInput (naming `field`) unless `samples` (N,) is a usable source recording."""
    seconds = check_samples(samples, sample_rate, field)
    if not MIN_SOURCE_SECONDS <= seconds <= MAX_SOURCE_SECONDS:
        raise InvalidInput(field, f"must be {MIN_SOURCE_SECONDS:g} to {MAX_SOURCE_SECONDS:g} s long, "
                                  f"got {seconds:.2f} s")


def source_at_16k(samples: np.ndarray, sample_rate: int, field: str = "source_audio") -> np.ndarray:
    """The checked source, mono, at the tokenizer's rate: (N,) -> (N * 16000 / rate,) float32."""
    samples = to_mono(samples)
    validate_source_audio(samples, sample_rate, field)
    return resample(samples, sample_rate, TOKENIZER_RATE)


def split_source(wav16k: np.ndarray, target_s: float = TARGET_PIECE_SECONDS,
                 search_s: float = CUT_SEARCH_SECONDS, max_s: float = MAX_PIECE_SECONDS) -> list[np.ndarray]:
    """(N,) at 16 kHz -> pieces of at most `max_s` seconds, cut at quiet token frames (the module's rule)."""
    max_samples = int(max_s * TOKENIZER_RATE)
    if wav16k.shape[0] <= max_samples:
        return [wav16k]
    assert target_s + search_s <= max_s, "a piece could exceed the tokenizer's limit"
    n_pieces = math.ceil(wav16k.shape[0] / (target_s * TOKENIZER_RATE))
    frames = wav16k.shape[0] // SAMPLES_PER_TOKEN
    energy = np.square(wav16k[:frames * SAMPLES_PER_TOKEN].reshape(frames, SAMPLES_PER_TOKEN)).sum(axis=1)
    search = int(search_s * TOKENIZER_RATE) // SAMPLES_PER_TOKEN  # frames either side
    cuts = [0]
    for k in range(1, n_pieces):
        nominal = round(k * frames / n_pieces)  # in frames
        low, high = max(cuts[-1] + 1, nominal - search), min(frames - 1, nominal + search)
        cuts.append(low + int(np.argmin(energy[low:high + 1])))  # the quietest frame starts the next piece
    bounds = [c * SAMPLES_PER_TOKEN for c in cuts] + [wav16k.shape[0]]
    pieces = [wav16k[a:b] for a, b in zip(bounds, bounds[1:])]
    assert all(p.shape[0] <= max_samples for p in pieces), [p.shape[0] for p in pieces]
    return pieces


class VoiceConverter:
    """Source recording -> audio chunks in the target voice, over a tokenizer and a token2wav stage."""

    def __init__(self, tokenize: Tokenizer, token2wav: Token2WavStage):
        self.tokenize = tokenize
        self.token2wav = token2wav

    def source_tokens(self, request: ConversionRequest) -> list[list[int]]:
        """The speech tokens of each piece of the request's source."""
        wav16k = source_at_16k(request.source, request.sample_rate)
        return [[int(t) for t in np.asarray(self.tokenize(piece)).reshape(-1)] for piece in split_source(wav16k)]

    def run(self, request: ConversionRequest, stream: bool, is_cancelled: Callable[[], bool] = lambda: False,
            stream_id: str | None = None) -> Iterator[np.ndarray]:
        """Yield float32 24 kHz chunks in order; not streamed: one chunk per piece. The request was checked where
        it entered the process (the model's parse: `ConversionInputs.check`; in-process, `request.validate()`)."""
        stream_id = stream_id or uuid.uuid4().hex
        seed = request.seed if request.seed is not None else random_seed()
        prompt = flow_prompt_of(request.voice)
        playback = Playback()
        for index, tokens in enumerate(self.source_tokens(request)):
            if is_cancelled():
                raise Cancelled("the client cancelled the request")
            yield from self._piece(f"{stream_id}/vc{index}", tokens, prompt, sentence_seeds(seed, index).vocoder,
                                   request, stream, is_cancelled, playback)

    def _piece(self, stream_id: str, tokens: list[int], prompt: FlowPrompt, vocoder_seed: int,
               request: ConversionRequest, stream: bool, is_cancelled: Callable[[], bool],
               playback: Playback) -> Iterator[np.ndarray]:
        """One piece as one token2wav stream: all its tokens are known, so chunks are due as the schedule says."""
        schedule = ChunkSchedule(request.chunk_policy, prompt.speech_tokens.shape[1])
        sender = ChunkSender(self.token2wav, stream_id, prompt, vocoder_seed, request.speed, playback)
        try:
            if stream:
                yield from sender.due(tokens, schedule, is_cancelled)
            yield sender.finish(tokens)
        finally:
            sender.close()


def local_converter(tts) -> VoiceConverter:
    """The in-process converter of a `cosyvoice2.CosyVoice` (either family): its prompt encoder's tokenizer and
    its reference token2wav (the same flow and vocoder as its synthesis)."""
    return VoiceConverter(tts.prompt_encoder.speech_tokens, tts.pipeline.token2wav)
