"""The per-request streaming logic: sentences -> speech tokens -> audio chunks.

The same code runs in-process (local backends) and inside the Triton `cosyvoice2` model (BLS backends
that call the `llm` and `token2wav` models), so both give the same audio for the same seed. For each
sentence it opens an LLM token stream, follows the chunk schedule (small first chunk, growing hops,
`lookahead` tokens of right context) and sends each due chunk's new tokens to token2wav. The
request's `Playback` follows its listener across sentences; an adaptive chunk policy reads its lead.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import numpy as np

from ..audio_out import SAMPLE_RATE
from ..errors import Cancelled
from ..preprocess.text import TextPreprocessor, validate_text
from ..messages import ChunkRequest, FlowPrompt, LLMRequest, SynthesisRequest
from .chunk_policy import ChunkSchedule
from .llm_generate import generate
from .playback import Playback
from .request import END_OF_PROMPT, random_seed, sentence_seeds


class TokenStream(Protocol):
    def __iter__(self) -> Iterator[list[int]]: ...

    def cancel(self) -> None: ...


class LLMStage(Protocol):
    def stream(self, request: LLMRequest) -> TokenStream: ...


class Token2WavStage(Protocol):
    def chunk(self, chunk: ChunkRequest) -> np.ndarray: ...

    def cancel(self, stream_id: str) -> None: ...


def flow_prompt_of(voice) -> FlowPrompt:
    """The flow-side prompt (tokens, mel, embedding) of a voice's PromptFeatures, as (1, ...) numpy arrays
    (views of the voice's arrays; token2wav copies them into torch once)."""
    return FlowPrompt(
        speech_tokens=np.asarray(voice.speech_tokens, dtype=np.int32)[None],
        mel=np.asarray(voice.mel, dtype=np.float32)[None],
        embedding=np.asarray(voice.embedding, dtype=np.float32).reshape(1, -1),
    )


class Orchestrator:
    def __init__(self, preprocessor: TextPreprocessor, llm: LLMStage, token2wav: Token2WavStage):
        self.preprocessor = preprocessor
        self.llm = llm
        self.token2wav = token2wav

    def llm_requests(self, request: SynthesisRequest, stream_id: str, seed: int) -> list[LLMRequest]:
        """Normalize and split the text; lay out each sentence's LLM prompt by mode."""
        encode = self.preprocessor.tokenizer.encode
        pieces = self.preprocessor.split(request.text, field="target_text") if request.text_frontend \
            else [validate_text(request.text, "target_text", self.preprocessor.max_chars)]  # as given: one piece
        prompt_text, prompt_speech = "", []
        if request.mode == "zero_shot":
            prompt_text = self.preprocessor.normalize(request.voice.text) if request.text_frontend else request.voice.text
            prompt_speech = [int(t) for t in request.voice.speech_tokens]
        elif request.mode == "instruct2":
            prompt_text = request.instruct_text.strip()
            if not prompt_text.endswith(END_OF_PROMPT):
                prompt_text += END_OF_PROMPT
        prompt_text_tokens = encode(prompt_text) if prompt_text else []
        return [LLMRequest(stream_id=f"{stream_id}/{i}", text_tokens=encode(piece),
                           prompt_text_tokens=prompt_text_tokens, prompt_speech_tokens=prompt_speech,
                           sampling=request.sampling, seed=sentence_seeds(seed, i).llm)
                for i, piece in enumerate(pieces)]

    def run(self, request: SynthesisRequest, stream: bool, is_cancelled: Callable[[], bool] = lambda: False,
            stream_id: str | None = None) -> Iterator[np.ndarray]:
        """Yield float32 audio chunks in order. Offline (`stream=False`) yields one chunk per sentence."""
        request.validate()
        stream_id = stream_id or uuid.uuid4().hex
        seed = request.seed if request.seed is not None else random_seed()
        prompt = flow_prompt_of(request.voice)
        playback = Playback()  # the listener of the whole request, sentence after sentence
        for index, llm_request in enumerate(self.llm_requests(request, stream_id, seed)):
            yield from self._sentence(request, llm_request, prompt, sentence_seeds(seed, index).vocoder,
                                      stream, is_cancelled, playback)

    def _sentence(self, request: SynthesisRequest, llm_request: LLMRequest, prompt: FlowPrompt, vocoder_seed: int,
                  stream: bool, is_cancelled: Callable[[], bool], playback: Playback) -> Iterator[np.ndarray]:
        stream_id = llm_request.stream_id
        schedule = ChunkSchedule(request.chunk_policy, prompt.speech_tokens.shape[1])
        tokens: list[int] = []
        sent = 0  # tokens already handed to token2wav
        opened = finished = False
        token_stream = self.llm.stream(llm_request)

        def send(end: int, finalize: bool) -> np.ndarray:
            nonlocal sent, opened
            chunk = ChunkRequest(stream_id=stream_id, tokens=tokens[sent:end], finalize=finalize,
                                 prompt=None if opened else prompt, seed=vocoder_seed)
            opened, sent = True, end
            audio = self.token2wav.chunk(chunk)
            if audio.size:
                playback.add(time.monotonic(), audio.size / SAMPLE_RATE)
            return audio

        try:
            for new_tokens in token_stream:
                if is_cancelled():
                    raise Cancelled("the client cancelled the request")
                tokens.extend(new_tokens)
                while stream and schedule.due(len(tokens), lead := playback.lead(time.monotonic())):
                    _, end = schedule.advance(len(tokens), lead)
                    yield send(end, finalize=False)
                    if is_cancelled():
                        raise Cancelled("the client cancelled the request")
            audio = send(len(tokens), finalize=True)
            finished = True
            yield audio
        finally:
            if not finished:
                token_stream.cancel()
                if opened:
                    self.token2wav.cancel(stream_id)


# ---- in-process backends --------------------------------------------------------------------------

class _GeneratorStream:
    """A TokenStream over a plain token iterator (the reference single-stream LLM loop)."""

    def __init__(self, tokens: Iterable[int]):
        self._tokens = iter(tokens)
        self._cancelled = False

    def __iter__(self) -> Iterator[list[int]]:
        for token in self._tokens:
            if self._cancelled:
                return
            yield [token]

    def cancel(self) -> None:
        self._cancelled = True


class ReferenceLLM:
    """LLMStage that runs `llm_generate.generate` in the caller's thread, one stream at a time."""

    def __init__(self, llm):
        self.llm = llm

    def stream(self, request: LLMRequest) -> TokenStream:
        import torch

        def as_tensor(ids: list[int]) -> torch.Tensor:
            return torch.tensor([ids], dtype=torch.int32).reshape(1, -1)

        tokens = generate(self.llm, as_tensor(request.text_tokens), as_tensor(request.prompt_text_tokens),
                          as_tensor(request.prompt_speech_tokens), request.sampling,
                          torch.Generator().manual_seed(request.seed))
        return _GeneratorStream(tokens)


class ReferenceToken2Wav:
    """Token2WavStage over single-stream `Token2WavStream`s, one flow call per chunk."""

    def __init__(self, token2wav):
        self.token2wav = token2wav
        self.streams: dict[str, object] = {}

    def chunk(self, chunk: ChunkRequest) -> np.ndarray:
        import torch

        from ..models.hift_source import GeneratorNoise

        state = self.streams.get(chunk.stream_id)
        if state is None:
            seed = chunk.seed if chunk.seed is not None else random_seed()
            state = self.token2wav.stream(chunk.prompt, GeneratorNoise(torch.Generator().manual_seed(seed)))
            self.streams[chunk.stream_id] = state
        audio = state.chunk(chunk.tokens, chunk.finalize)
        if chunk.finalize:
            del self.streams[chunk.stream_id]
        return audio

    def cancel(self, stream_id: str) -> None:
        state = self.streams.pop(stream_id, None)
        if state is not None:
            state.close()

