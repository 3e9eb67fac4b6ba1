"""The per-request streaming logic: sentences -> speech tokens -> audio chunks.

The same code runs in-process (local stages) and inside the Triton `cosyvoice2` model (BLS stages
that call the `llm` and `token2wav` models), so both give the same audio for the same seed. For each
sentence it opens an LLM token stream, follows the chunk schedule (small first chunk, growing hops,
`lookahead` tokens of right context) and sends each due chunk's new tokens to token2wav (long runs of
silence tokens dropped, where the family names them: pipeline/silent_runs.py). The family's text forms
(`TextPreprocessor.family`: CosyVoice3's system prompt and `<|endofprompt|>`) shape each mode's LLM prompt. The
request's `Playback` follows its listener across sentences; an adaptive chunk policy reads its lead.

`run_bistream` takes the text as it is written instead (text_mode "bistream"): one LLM stream reads it
as it comes, in the trained 5:15 text/speech pattern (llm/bistream.py), so audio starts before the
first sentence is complete. A feeder thread tokenizes the pieces (cut before white space: `WordPieces`)
and appends them to the live LLM stream while this thread turns its tokens into audio. As in the official
bistream, the text is spoken as given (no normalization, no sentence splitting).

SSML text (`preprocess/ssml.py`: text_type "ssml", or text that starts with <speak) is parsed, and every voice
and sentence laid out, before any audio (`ssml_plan`); then its parts run in order: each speech run's sentences
(split within the run) in its voice and speed, each <break> as one chunk of zeros (offline too). Sentences are
counted across the whole document for their seeds (`sentence_seeds(seed, i)`), so a seed gives the same audio.

With `request.marks`, `run` yields speech marks among the chunks (pipeline/speech_marks.py): each sentence's mark
before its audio and its MarkEnd after, each <mark> and <break> where it falls; the audio is the same as without.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from ..errors import Cancelled, InvalidInput, NotFound
from ..messages import MAX_SPEED, MIN_SPEED, FlowPrompt, LLMRequest, PromptFeatures, SynthesisRequest
from ..preprocess.spans import source_spans
from ..preprocess.ssml import Mark, Pause, Speech, expand_say_as, is_ssml, language, parse_ssml, spoken_text
from ..preprocess.text import TextPreprocessor, is_only_punctuation
from ..wire.checks import validate_text
from ..wire.names import TARGET_TEXT
from .chunk_policy import ChunkSchedule
from .chunk_sender import ChunkSender
from .playback import Playback
from .silent_runs import SilentRuns
from .stages import LLMStage, Token2WavStage, TokenStream
from .seeds import random_seed, sentence_seeds
from .speech_marks import MarkClock, MarkEvent, source_value
from .text_feed import TextFeed, WordPieces


log = logging.getLogger(__name__)


def flow_prompt_of(voice) -> FlowPrompt:
    """The flow-side prompt (tokens, mel, embedding) of a voice's PromptFeatures, as (1, ...) numpy arrays
    (views of the voice's arrays; token2wav copies them into torch once)."""
    return FlowPrompt(
        speech_tokens=np.asarray(voice.speech_tokens, dtype=np.int32)[None],
        mel=np.asarray(voice.mel, dtype=np.float32)[None],
        embedding=np.asarray(voice.embedding, dtype=np.float32).reshape(1, -1),
    )


@dataclass(frozen=True)
class SpokenSentence:
    """One sentence of an SSML document, laid out: its LLM request, its voice's flow prompt, its speed."""

    llm_request: LLMRequest
    prompt: FlowPrompt
    speed: float
    vocoder_seed: int
    span: tuple[int, int] = (0, 0)  # characters of the request text it came from (speech marks)
    value: str = ""  # its text there, as written (tags dropped)


class Pipeline:
    def __init__(self, preprocessor: TextPreprocessor, llm: LLMStage, token2wav: Token2WavStage):
        self.preprocessor = preprocessor
        self.llm = llm
        self.token2wav = token2wav

    def pieces(self, request: SynthesisRequest, lang: str | None = None) -> list[str]:
        """The request text's sentences: normalized (in `lang`, "zh" or "en"; None: detected) and split, or
        (text_frontend false) the text as given."""
        if request.text_frontend:
            return self.preprocessor.split(request.text, field=TARGET_TEXT, lang=lang)
        return [request.text]  # as given: one piece

    def llm_requests(self, request: SynthesisRequest, stream_id: str, seed: int, first: int = 0,
                     pieces: list[str] | None = None) -> list[LLMRequest]:
        """Normalize and split the text (or take its `pieces`); lay out each sentence's LLM prompt by mode.
        `first`: the index of the first sentence in the request (its seeds and stream id)."""
        encode = self.preprocessor.tokenizer.encode
        pieces = self.pieces(request) if pieces is None else pieces
        prompt_text_tokens, prompt_speech = self.prompt_tokens(request)
        return [LLMRequest(stream_id=f"{stream_id}/{i}", text_tokens=encode(self.text_prefix(request, piece) + piece),
                           prompt_text_tokens=prompt_text_tokens, prompt_speech_tokens=prompt_speech,
                           sampling=request.sampling, seed=sentence_seeds(seed, i).llm)
                for i, piece in enumerate(pieces, start=first)]

    def text_prefix(self, request: SynthesisRequest, piece: str) -> str:
        """What the family reads before a sentence that has no prompt text in front (cross_lingual in
        CosyVoice3: the system prompt and <|endofprompt|>, in the text as the official API takes it, so the
        length limits count it as the official's do); "" otherwise."""
        return self.preprocessor.family.text_prefix(piece) if request.mode == "cross_lingual" else ""

    def ssml_plan(self, request: SynthesisRequest, stream_id: str, seed: int) -> list[SpokenSentence | Pause | Mark]:
        """The SSML document's sentences, pauses and marks in order, every voice resolved: all its errors
        (InvalidInput / NotFound naming target_text) come before any audio. Marks make no audio."""
        field = TARGET_TEXT
        parts = parse_ssml(request.text, field, expand_say_as)
        validate_text(spoken_text(parts), field, self.preprocessor.max_chars)
        voices: dict[str | None, PromptFeatures] = {None: request.voice}
        plan: list[SpokenSentence | Pause | Mark] = []
        sentences = 0
        for part in parts:
            if isinstance(part, (Pause, Mark)):
                plan.append(part)
                continue
            if is_only_punctuation(part.text.replace(" ", "")):
                continue  # nothing to speak (".", a lone tag's neighbour)
            speed = request.speed * part.speed
            if not MIN_SPEED <= speed <= MAX_SPEED:
                raise InvalidInput(field, f"SSML <prosody>: speed {request.speed:g} times rate {part.speed:g} is "
                                          f"outside {MIN_SPEED} .. {MAX_SPEED}")
            voice = self.voice_of(request, part.voice_id, voices)
            spoken = replace(request, text=part.text, voice=voice)
            prompt = flow_prompt_of(voice)
            pieces = self.pieces(spoken, language(part.lang) if part.lang else None)  # <lang>, xml:lang
            spans = self.part_spans(request.text, part, pieces) if request.marks else [part.span] * len(pieces)
            for llm_request, span in zip(self.llm_requests(spoken, stream_id, seed, first=sentences, pieces=pieces),
                                         spans):
                plan.append(SpokenSentence(llm_request, prompt, speed, sentence_seeds(seed, sentences).vocoder, span,
                                           source_value(request.text, span, ssml=True) if request.marks else ""))
                sentences += 1  # sentences count across the document
        return plan

    @staticmethod
    def part_spans(text: str, part: Speech, pieces: list[str]) -> list[tuple[int, int]]:
        """The span of each sentence of an SSML speech run in the document: aligned within the run's span."""
        start, end = part.span
        return [(start + a, start + b) for a, b in source_spans(text[start:end], pieces)]

    @staticmethod
    def voice_of(request: SynthesisRequest, voice_id: str | None,
                 voices: dict[str | None, PromptFeatures]) -> PromptFeatures:
        """An SSML part's voice (<voice name>; None: the request's), resolved once per document."""
        if voice_id not in voices:
            if request.voice_of is None:
                raise InvalidInput(TARGET_TEXT, f"SSML <voice name={voice_id!r}>: voices cannot be switched here")
            try:
                voices[voice_id] = request.voice_of(voice_id)
            except KeyError:  # NotFound too
                raise NotFound(TARGET_TEXT, f"SSML <voice name={voice_id!r}>: no voice {voice_id!r} is "
                                           "registered") from None
            if request.mode == "zero_shot" and not voices[voice_id].text.strip():
                raise InvalidInput(TARGET_TEXT, f"SSML <voice name={voice_id!r}>: the voice has no transcript, "
                                               "which zero_shot mode needs")
        return voices[voice_id]

    def prompt_tokens(self, request: SynthesisRequest, bistream: bool = False) -> tuple[list[int], list[int]]:
        """(prompt text tokens, prompt speech tokens) of the request's mode, in the family's text forms
        (family.py: the zero-shot transcript behind CosyVoice3's system prompt, the instruction's form). A
        bistream cross_lingual request takes the family's text prefix as its prompt text (its text comes later)."""
        family = self.preprocessor.family
        prompt_text, prompt_speech = "", []
        if request.mode == "zero_shot":
            prompt_text = family.zero_shot_prompt(request.voice.text)
            prompt_text = self.preprocessor.normalize(prompt_text) if request.text_frontend else prompt_text
            prompt_speech = [int(t) for t in request.voice.speech_tokens]
        elif request.mode == "instruct2":
            prompt_text = family.instruction(request.instruct_text)
        elif bistream:
            prompt_text = family.text_prefix(request.text)
        return self._encode(prompt_text), prompt_speech

    def run(self, request: SynthesisRequest, stream: bool, is_cancelled: Callable[[], bool] = lambda: False,
            stream_id: str | None = None) -> Iterator[np.ndarray | MarkEvent]:
        """Yield float32 audio chunks in order. Offline (`stream=False`) yields one chunk per sentence. With
        `request.marks`, speech marks too, each before the audio it describes (pipeline/speech_marks.py). The
        request was checked where it entered the process (the model's parse, `CosyVoice.synthesize`)."""
        stream_id = stream_id or uuid.uuid4().hex
        seed = request.seed if request.seed is not None else random_seed()
        playback = Playback()  # the listener of the whole request, sentence after sentence
        clock = MarkClock() if request.marks else None
        if is_ssml(request.text, request.text_type):
            yield from self._run_plan(request, self.ssml_plan(request, stream_id, seed), stream, is_cancelled,
                                      playback, clock)
            return
        prompt = flow_prompt_of(request.voice)
        pieces = self.pieces(request)
        spans = source_spans(request.text, pieces) if clock else [(0, 0)] * len(pieces)
        for index, (llm_request, span) in enumerate(zip(self.llm_requests(request, stream_id, seed, pieces=pieces),
                                                        spans)):
            chunks = self._sentence(request, llm_request, prompt, sentence_seeds(seed, index).vocoder,
                                    stream, is_cancelled, playback)
            yield from clock.sentence(span, source_value(request.text, span, ssml=False), chunks) if clock else chunks

    def _run_plan(self, request: SynthesisRequest, plan: list[SpokenSentence | Pause | Mark], stream: bool,
                  is_cancelled: Callable[[], bool], playback: Playback,
                  clock: MarkClock | None = None) -> Iterator[np.ndarray | MarkEvent]:
        for step in plan:
            if isinstance(step, Mark):  # a named point: no audio
                if clock:
                    yield clock.point(step.name, step.span)
                continue
            if isinstance(step, Pause):  # a <break>: its own chunk of silence
                if is_cancelled():
                    raise Cancelled("the client cancelled the request")
                if clock:
                    yield clock.pause(step.samples, step.span)
                if step.samples:
                    yield np.zeros(step.samples, dtype=np.float32)
                continue
            chunks = self._sentence(request, step.llm_request, step.prompt, step.vocoder_seed, stream,
                                    is_cancelled, playback, speed=step.speed)
            yield from clock.sentence(step.span, step.value, chunks) if clock else chunks

    def run_bistream(self, request: SynthesisRequest, text: Iterable[str], stream: bool,
                     is_cancelled: Callable[[], bool] = lambda: False,
                     stream_id: str | None = None) -> Iterator[np.ndarray]:
        """Yield float32 audio chunks while `text` yields the rest of the text in pieces (it may wait for
        each); `request.text` is its first piece (may be empty). Offline (`stream=False`): one chunk. The
        request was checked where it entered the process (the model's parse)."""
        stream_id = stream_id or uuid.uuid4().hex
        seeds = sentence_seeds(request.seed if request.seed is not None else random_seed(), 0)
        prompt_text_tokens, prompt_speech = self.prompt_tokens(request, bistream=True)
        words = WordPieces()
        llm_request = LLMRequest(stream_id=f"{stream_id}/0", text_tokens=self._encode(words.feed(request.text)),
                                 prompt_text_tokens=prompt_text_tokens, prompt_speech_tokens=prompt_speech,
                                 sampling=request.sampling, seed=seeds.llm, bistream=True)
        token_stream = self.llm.stream(llm_request)
        feeder = _TextFeeder(token_stream, text, words, self._encode, is_cancelled)

        def failed() -> bool:  # the client cancelled, or the text feed failed
            return is_cancelled() or feeder.error is not None

        try:
            yield from self._sentence(request, llm_request, flow_prompt_of(request.voice), seeds.vocoder, stream,
                                      failed, Playback(), token_stream)
        except Cancelled:
            feeder.check()  # the feed's error, rather than a cancellation
            raise
        finally:
            feeder.stop()
        feeder.check()

    def _encode(self, text: str) -> list[int]:
        return self.preprocessor.tokenizer.encode(text) if text else []

    def _sentence(self, request: SynthesisRequest, llm_request: LLMRequest, prompt: FlowPrompt, vocoder_seed: int,
                  stream: bool, is_cancelled: Callable[[], bool], playback: Playback,
                  token_stream: TokenStream | None = None, speed: float | None = None) -> Iterator[np.ndarray]:
        schedule = ChunkSchedule(request.chunk_policy, prompt.speech_tokens.shape[1])
        speed = request.speed if speed is None else speed
        sender = ChunkSender(self.token2wav, llm_request.stream_id, prompt, vocoder_seed, speed, playback)
        tokens: list[int] = []
        silent_runs = SilentRuns(self.preprocessor.family)
        token_stream = token_stream if token_stream is not None else self.llm.stream(with_lead(llm_request, playback))
        try:
            for new_tokens in token_stream:
                if is_cancelled():
                    raise Cancelled("the client cancelled the request")
                tokens.extend(silent_runs.keep(new_tokens))
                if stream:
                    yield from sender.due(tokens, schedule, is_cancelled)
            yield sender.finish(tokens)
        finally:
            if not sender.finished:
                token_stream.cancel()
                sender.close()


def with_lead(request: LLMRequest, playback: Playback) -> LLMRequest:
    """The sentence's LLM request with its listener's lead, when one listens: the LLM gives a free slot to
    the least lead first (llm/scheduler.py)."""
    if playback.played_until is None:
        return request
    return replace(request, lead_s=max(0.0, playback.lead(time.monotonic())))


class _TextFeeder:
    """A thread that appends a bistream synthesis's text to its LLM stream as the pieces come: each piece
    cut before white space (`WordPieces`), tokenized, appended; at the end of the text, the rest and the end."""

    def __init__(self, token_stream: TokenStream, text: Iterable[str], words: WordPieces,
                 encode: Callable[[str], list[int]], is_cancelled: Callable[[], bool]):
        self._stream = token_stream
        # A TextFeed is watched for a cancel while it waits: the text then ends, so that an LLM stream waiting
        # for it goes on and the synthesis, at its next token, sees the cancel.
        self._text = text.pieces(is_cancelled) if isinstance(text, TextFeed) else text
        self._words = words
        self._encode = encode
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bistream-text", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for piece in self._text:
                if self._stopped.is_set():
                    return
                if not isinstance(piece, str):
                    raise TypeError(f"bistream text pieces must be strings, got {type(piece).__name__}")
                ready = self._words.feed(piece)
                if ready:
                    self._stream.append_text(self._encode(ready))
            if not self._stopped.is_set():
                self._stream.append_text(self._encode(self._words.flush()), end=True)
        except BaseException as exc:  # noqa: BLE001 - handed to the synthesis, which fails with it
            if self._stopped.is_set():
                return
            if not isinstance(exc, Cancelled):
                log.warning("bistream text feed failed: %s", exc)
                self.error = exc
            try:  # end the text, so that an LLM stream waiting for it goes on and the synthesis sees the error
                self._stream.append_text([], end=True)
            except Exception:  # noqa: BLE001 - the synthesis ends on the error anyway
                pass

    def stop(self) -> None:
        """The synthesis is over: later pieces are dropped (the thread ends when its text source does)."""
        self._stopped.set()

    def check(self) -> None:
        """Raise the feed's error, if it failed (the LLM stream was cancelled for it)."""
        if self.error is not None:
            raise self.error
