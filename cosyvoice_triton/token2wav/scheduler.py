"""Token2wav for many streams at once: chunks of different streams share one flow call.

The Triton `token2wav` model hands `Token2WavScheduler.run` the chunks that its dynamic batcher gathered,
each the next piece of one stream. The scheduler keeps the state of every live stream by id (prompt, tokens
so far, token offset, vocoder caches) and gives each stream exactly the audio of a solo `Token2WavStream`
with the same chunk boundaries and vocoder seed:

- a non-final chunk runs the flow on all tokens so far (streaming), keeps the mel frames from
  2 * offset to 2 * (len(tokens) - lookahead), and moves the offset there;
- the final chunk runs the flow on all tokens (not streaming, finalize) and keeps the frames from
  2 * offset on; the state is freed afterwards.
With the flow cache (`FlowCacheSettings`, on by default for the torch flow) each stream keeps the
estimator's state of its frames that are final, and a call computes only the frames after them
(models/flow_cache.py); `cached_final` makes the final chunk a cached streaming call too. A new stream of a
prompt seen before starts with its voice-final frames from the `PromptCache` (models/prompt_cache.py), filled
by the first streaming call of the first stream of that prompt.

Either family: the flow cache is the family's (models/family.py: CosyVoice2's UNet cache, CosyVoice3's DiT
cache, the same contract) and each stream's vocoder stream too (token2wav/vocoders.py: HiFT with its
cross-fade and the stream's seeded noise, or the causal HiFT on a window with its fixed noise).

All chunks of one `run` go through one flow call (rows padded; the flow masks per row), at most
`max_batch` rows, earliest deadline first: a stream's deadline is the moment its listener would run dry
(the clock time of its first audio + the seconds of audio made since), a new stream's is now; so first
chunks and streams that are running low go before streams that are well ahead. A stream's `speed` (its
first chunk's) stretches its mel before HiFT (token2wav/speed.py).

Batch invariance (the torch flow with its cache, on a CPU): a stream's audio does not depend on the streams
beside it. Each stream's encoder pass and its estimator rows run alone, over its own frames, on the rows'
fixed thread count (`map_rows`, pipeline/threads.py `RowWorkers`; `_conditions_by_row`, models/flow_cache.py
`_solve_by_row`), and HiFT takes one row a call. What still follows the batch is the call's thread count
(a first chunk in it gives every core to HiFT and the chunk bookkeeping): ~1e-7 at most, measured. A chunk that fails its checks changes
nothing, and a stream's tokens, offset and caches change only once the audio of its whole batch is made
(an unexpected failure of the batch leaves them as they were; only a vocoder noise generator may have
moved on).
One caller at a time: Triton runs `execute` of an instance serially.

Idle rule. The idle timeout frees the stream of a frontend that died or left without cancelling; it must
never free a live one (on an overloaded machine a live stream's next chunk can come minutes later). So a
stream's idle clock starts when its latest chunk is answered (not when it came), it counts only the time
this scheduler spends outside `run` (the "quiet clock": while a batch runs, chunks queued behind it in
Triton wait on it, so that time says nothing about their frontends), and a stream with a chunk in the
current `run` is never freed, whatever its clock says. A stream is freed after `idle_timeout_s` of quiet
time without a chunk: its frontend is gone, or its LLM took longer than that for one hop while token2wav
sat idle (the timeout must exceed the longest hop). The cost: under an overload that keeps token2wav busy
without a gap, an abandoned stream keeps its slot until the first gap. Not chosen: renewal by the frontend
(a new message on every path to token2wav and a timer in every frontend) and a timeout scaled by a load
figure (which one, and it can still be exceeded).
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass, fields
from typing import Callable, Collection

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from ..errors import CosyVoiceError, InvalidInput, NotFound, Unavailable
from ..models.family import Vocoder, models_of_flow
from ..models.flow import FlowConditions, TokenToMel
from ..models.flow_cache import FlowCacheSettings, MapRows, StreamFlowCache
from ..models.prompt_cache import PromptCache, frames_to_store, new_stream_cache, stage_prompt_cache
from ..messages import MIN_HOP_TOKENS, ChunkRequest, FlowPrompt, check_seed
from .stream import prompt_tensors
from .vocoders import AnyVocoderStream, vocoder_stream_class

log = logging.getLogger(__name__)

FREE_REASONS = ("finalize", "cancel", "idle")


@dataclass(frozen=True)
class Token2WavStats:
    active_streams: int
    flow_calls: int
    last_flow_batch: int  # rows of the latest flow call
    max_flow_batch: int
    mean_flow_batch: float
    chunks_served: int
    chunks_failed: int
    freed: dict[str, int]  # streams freed, by reason (FREE_REASONS)
    flow_cache_bytes: int = 0  # the live streams' flow caches
    prompt_cache_bytes: int = 0  # the voices' frames kept (models/prompt_cache.py)
    prompt_cache_hits: int = 0  # streams that started from a voice's kept frames


@dataclass
class _Stream:
    prompt: FlowPrompt  # on the flow's device
    vocoder: AnyVocoderStream
    tokens: list[int]
    offset: int  # tokens already turned into audio
    first_audio_at: float | None = None  # clock() when its first audio was made; None: none yet
    audio_s: float = 0.0  # seconds of audio made so far
    flow_cache: StreamFlowCache | None = None  # None: the flow cache is off
    answered_at: float = 0.0  # the quiet clock when its latest chunk was answered (set by run)

    def deadline(self, now: float) -> float:
        """When this stream's listener runs dry if it gets no more audio (now, before its first audio)."""
        return now if self.first_audio_at is None else self.first_audio_at + self.audio_s


@dataclass
class _Row:
    """One chunk planned into a flow batch; the stream is updated only when its audio is made."""

    index: int  # position in run()'s input
    stream_id: str
    stream: _Stream
    tokens: list[int]  # the stream's tokens including this chunk's
    finalize: bool
    new_offset: int
    flow_cache: StreamFlowCache | None = None  # the stream's cache once this row's audio is made


class Token2WavScheduler:
    def __init__(self, flow: TokenToMel, hift: Vocoder, *, max_streams: int = 64, max_batch: int = 16,
                 idle_timeout_s: float = 120.0, lookahead: int | None = None,
                 clock: Callable[[], float] = time.monotonic, flow_cache: FlowCacheSettings = FlowCacheSettings(),
                 prompt_cache: PromptCache | None = None, map_rows: MapRows | None = None):
        self.flow = flow
        models = models_of_flow(flow)  # the family's cache (models/family.py); its vocoder stream below
        self._cached_solver = models.cached_mel
        # Graph engines (ONNX, TensorRT, OpenVINO) re-run the flow over every frame.
        self.flow_cache = models.cache_settings(flow, flow_cache)
        # With the flow cache: the estimator's rows one by one, spread over the cores (pipeline/threads.py
        # RowWorkers); None: one pass over the padded batch per Euler step.
        self.map_rows = map_rows if self.flow_cache is not None else None
        # The voices' share of the flow (models/prompt_cache.py); pass one to share it with another stage.
        self.prompt_cache = stage_prompt_cache(self.flow_cache, prompt_cache)
        self.hift = hift
        self.vocoder_stream = vocoder_stream_class(hift)
        self.max_streams = max_streams
        self.max_batch = max_batch
        self.idle_timeout_s = idle_timeout_s
        self.lookahead = flow.config.pre_lookahead_len if lookahead is None else lookahead
        if self.lookahead < flow.config.pre_lookahead_len:
            # The flow makes no frames for its last pre_lookahead_len tokens; a shorter hold-back would skip them.
            raise ValueError(f"lookahead {self.lookahead} < the flow's pre_lookahead_len "
                             f"{flow.config.pre_lookahead_len}")
        if max_streams < 1 or max_batch < 1:
            raise ValueError(f"max_streams ({max_streams}) and max_batch ({max_batch}) must be >= 1")
        self.clock = clock
        self.ratio = flow.config.token_mel_ratio
        self.device = next(flow.parameters()).device
        self._streams: dict[str, _Stream] = {}
        self._flow_calls = self._flow_rows = self._last_batch = self._max_batch_seen = 0
        self._served = self._failed = 0
        self._freed = dict.fromkeys(FREE_REASONS, 0)
        self._busy_s = 0.0  # clock seconds spent in run(): the quiet clock stands still then

    # ---- public API ----

    def run(self, chunks: list[ChunkRequest]) -> list[np.ndarray | Exception]:
        """Audio (N,) float32 per chunk, or the error of that chunk, in input order."""
        in_hand = {chunk.stream_id for chunk in chunks}  # alive: their frontends just sent a chunk
        self.sweep_idle(keep=in_hand)
        started = self.clock()
        try:
            return self._run(chunks, started)
        finally:
            self._busy_s += self.clock() - started
            quiet = self.quiet_clock()
            for stream_id in in_hand & self._streams.keys():
                self._streams[stream_id].answered_at = quiet

    def _run(self, chunks: list[ChunkRequest], now: float) -> list[np.ndarray | Exception]:
        results: list[np.ndarray | Exception | None] = [None] * len(chunks)
        pending: dict[str, deque[int]] = defaultdict(deque)  # per stream, its chunks in input order
        for index, chunk in enumerate(chunks):
            pending[chunk.stream_id].append(index)
        while pending:
            rows = self._next_batch(chunks, pending, results, now)
            if rows:
                self._serve(rows, results)
            pending = {sid: queue for sid, queue in pending.items() if queue}
        self._served += sum(isinstance(r, np.ndarray) for r in results)
        self._failed += sum(isinstance(r, Exception) for r in results)
        return results  # every slot is filled: each index left its queue as a row or an error

    def cancel(self, stream_id: str) -> bool:
        """Free a stream's state now; False if there was none."""
        return self._free(stream_id, "cancel")

    def quiet_clock(self) -> float:
        """Clock seconds minus those spent in run() (outside run only): the idle rule's clock."""
        return self.clock() - self._busy_s

    def sweep_idle(self, keep: Collection[str] = ()) -> list[str]:
        """Free the streams other than `keep` whose latest chunk was answered more than idle_timeout_s ago on
        the quiet clock (see the module docstring); returns their ids."""
        quiet = self.quiet_clock()
        idle = [sid for sid, s in self._streams.items()
                if sid not in keep and quiet - s.answered_at > self.idle_timeout_s]
        for stream_id in idle:
            self._free(stream_id, "idle")
        return idle

    @property
    def stats(self) -> Token2WavStats:
        return Token2WavStats(
            active_streams=len(self._streams), flow_calls=self._flow_calls, last_flow_batch=self._last_batch,
            max_flow_batch=self._max_batch_seen,
            mean_flow_batch=self._flow_rows / self._flow_calls if self._flow_calls else 0.0,
            chunks_served=self._served, chunks_failed=self._failed, freed=dict(self._freed),
            flow_cache_bytes=sum(s.flow_cache.nbytes for s in self._streams.values() if s.flow_cache is not None),
            prompt_cache_bytes=self.prompt_cache.nbytes if self.prompt_cache is not None else 0,
            prompt_cache_hits=self.prompt_cache.hits if self.prompt_cache is not None else 0)

    def deadline(self, stream_id: str, now: float) -> float:
        """The clock time at which a stream's listener would run dry (`now` for a stream with no audio yet)."""
        stream = self._streams.get(stream_id)
        return now if stream is None else stream.deadline(now)

    # ---- planning ----

    def _next_batch(self, chunks: list[ChunkRequest], pending: dict[str, deque[int]],
                    results: list, now: float) -> list[_Row]:
        """Take up to max_batch chunks, at most one per stream, earliest deadline first (ties: input order).
        Chunks that fail their checks get their error and take no place in the batch."""
        heads = sorted((queue[0] for queue in pending.values()),
                       key=lambda i: (self.deadline(chunks[i].stream_id, now), i))
        rows: list[_Row] = []
        for index in heads:
            if len(rows) == self.max_batch:
                break
            chunk = chunks[index]
            pending[chunk.stream_id].popleft()
            opening = sum(row.stream_id not in self._streams for row in rows)  # new streams in this batch
            try:
                rows.append(self._plan(index, chunk, opening))
            except CosyVoiceError as error:
                results[index] = error
        return rows

    def _plan(self, index: int, chunk: ChunkRequest, new_in_batch: int) -> _Row:
        stream = self._streams.get(chunk.stream_id)
        if stream is None:
            stream = self._open(chunk, new_in_batch)
        self._check_tokens(chunk.tokens)
        tokens = stream.tokens + list(chunk.tokens)
        new_offset = len(tokens) if chunk.finalize else len(tokens) - self.lookahead
        if not chunk.finalize and new_offset - stream.offset < MIN_HOP_TOKENS:
            # The vocoder holds back 8 mel frames (4 tokens) of every non-final chunk (cross-fade or look-ahead).
            raise InvalidInput("tokens", f"a non-final chunk must advance the stream by >= {MIN_HOP_TOKENS} "
                               f"tokens after {self.lookahead} lookahead tokens; {len(tokens)} tokens in all, "
                               f"{stream.offset} already spoken")
        stream.vocoder.check_chunk(self.ratio * (new_offset - stream.offset), chunk.finalize)  # errors name speed
        frames = self.ratio * (stream.prompt.speech_tokens.shape[1] + len(tokens)
                               - (0 if chunk.finalize else self.flow.config.pre_lookahead_len))
        if frames > self.flow.config.noise_frames:
            raise InvalidInput("tokens", f"{frames} mel frames with the prompt exceed the flow's "
                               f"{self.flow.config.noise_frames}-frame limit")
        return _Row(index, chunk.stream_id, stream, tokens, chunk.finalize, new_offset, stream.flow_cache)

    def _open(self, chunk: ChunkRequest, new_in_batch: int) -> _Stream:
        """A new stream's state; it is registered once its first chunk is served."""
        if chunk.prompt is None:
            raise NotFound("stream_id", f"no stream {chunk.stream_id!r}: it ended, was cancelled or timed out, "
                           "or its first chunk carried no prompt")
        if len(self._streams) + new_in_batch >= self.max_streams:
            raise Unavailable(f"stream {chunk.stream_id!r}: all max_streams={self.max_streams} stream slots "
                              "are in use")
        prompt = self._check_prompt(chunk.prompt)
        if chunk.seed is not None:
            check_seed(chunk.seed)
        vocoder = self.vocoder_stream(self.hift, noise=self.vocoder_stream.seeded_noise(chunk.seed),
                                      speed=chunk.speed)  # errors name speed
        flow_cache = new_stream_cache(self.flow, self.flow_cache, self.prompt_cache, prompt)
        return _Stream(prompt, vocoder, [], 0, flow_cache=flow_cache)

    def _check_tokens(self, tokens: list[int], field: str = "tokens") -> None:
        vocab = self.flow.config.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise InvalidInput(field, f"speech tokens must be in [0, {vocab})")

    def _check_prompt(self, prompt: FlowPrompt) -> FlowPrompt:
        """Shapes and values checked; as torch tensors on the flow's device (the one conversion)."""
        prompt = prompt_tensors(prompt)
        config = self.flow.config
        P = prompt.speech_tokens.shape[-1]
        expected = {"prompt.speech_tokens": (prompt.speech_tokens, (1, P)),
                    "prompt.mel": (prompt.mel, (1, self.ratio * P, config.mel_bins)),
                    "prompt.embedding": (prompt.embedding, (1, config.spk_embed_dim))}
        for field, (tensor, shape) in expected.items():
            if tuple(tensor.shape) != shape:
                raise InvalidInput(field, f"shape {tuple(tensor.shape)}, expected {shape}")
        if prompt.speech_tokens.is_floating_point():
            raise InvalidInput("prompt.speech_tokens", f"must be integers, got {prompt.speech_tokens.dtype}")
        self._check_tokens(prompt.speech_tokens[0].tolist(), "prompt.speech_tokens")
        return FlowPrompt(speech_tokens=prompt.speech_tokens.to(self.device, torch.int32),
                          mel=prompt.mel.to(self.device, torch.float32),
                          embedding=prompt.embedding.to(self.device, torch.float32))

    # ---- serving ----

    def _serve(self, rows: list[_Row], results: list) -> None:
        """Audio for every row of one batch; on an unexpected failure every row gets the error."""
        try:
            audio = self._synthesize(rows)
        except Exception as error:  # e.g. out of device memory: the streams stay as they were
            log.exception("token2wav batch of %d chunks failed", len(rows))
            for row in rows:
                results[row.index] = error
            return
        for row, samples in zip(rows, audio):
            results[row.index] = samples

    @torch.inference_mode()
    def _synthesize(self, rows: list[_Row]) -> list[np.ndarray]:
        """Flow, then the vocoder, then the state updates -> audio (N,) float32 per row."""
        new_mels = self._flow_mels(rows)
        prepared = [row.stream.vocoder.prepare(mel, row.finalize) for row, mel in zip(rows, new_mels)]
        vocoded = self._vocode(rows, prepared)
        # Only now, with every row's audio made, do the streams change.
        audio = []
        for row, given, made in zip(rows, prepared, vocoded):
            if made is None:  # nothing to speak and nothing cached: a stream with no tokens at all
                audio.append(np.zeros(0, dtype=np.float32))
            else:
                audio.append(row.stream.vocoder.commit(given, made, row.finalize)[0].float().cpu().numpy())
            self._commit(row, audio[-1].size)
        return audio

    def _flow_mels(self, rows: list[_Row]) -> list[Tensor]:
        """One flow call for the rows that have new frames -> each row's new frames (1, 80, T_b)."""
        spans = [(self.ratio * row.stream.offset, self.ratio * row.new_offset) for row in rows]
        active = [b for b, (start, end) in enumerate(spans) if end > start]
        empty = torch.zeros(1, self.flow.config.mel_bins, 0, device=self.device)
        new_mels = [empty] * len(rows)
        if not active:
            return new_mels
        batch = [rows[b] for b in active]
        prompts = [row.stream.prompt for row in batch]
        tokens = [torch.tensor(row.tokens, dtype=torch.int32, device=self.device) for row in batch]
        prompt_tokens = [p.speech_tokens[0] for p in prompts]  # (P_b,)
        prompt_mels = [p.mel[0] for p in prompts]  # (2 P_b, 80)
        finalize = torch.tensor([row.finalize for row in batch], device=self.device)
        streaming = ~finalize | (self.flow_cache is not None and self.flow_cache.cached_final)
        inputs = dict(
            token=pad_sequence(tokens, batch_first=True), token_len=_lengths(tokens),
            prompt_token=pad_sequence(prompt_tokens, batch_first=True), prompt_token_len=_lengths(prompt_tokens),
            prompt_feat=pad_sequence(prompt_mels, batch_first=True), prompt_feat_len=_lengths(prompt_mels),
            embedding=torch.cat([p.embedding for p in prompts]), streaming=streaming, finalize=finalize)
        if self.flow_cache is None:
            mel = self.flow.inference(**inputs)  # (B, 80, max frames), row b from the first token after its prompt
            firsts = [0] * len(batch)
        else:
            mel, firsts = self._cached_flow(batch, inputs)  # row b from its frame firsts[b] after its prompt
        self._count_flow_call(len(batch))
        for row_in_batch, b in enumerate(active):
            start, end = spans[b]
            first = firsts[row_in_batch]
            # A copy: the vocoder caches a slice of it, which must not keep the whole batch alive.
            new_mels[b] = mel[row_in_batch:row_in_batch + 1, :, start - first:end - first].clone()
        return new_mels

    def _cached_flow(self, batch: list[_Row], inputs: dict) -> tuple[Tensor, list[int]]:
        """The flow call with the streams' caches; sets each row's cache to keep -> (mel (B, 80, N), first
        frame after the prompt per row)."""
        conditions = self.flow.conditions(**inputs) if self.map_rows is None else \
            _conditions_by_row(self.flow, inputs, self.map_rows)
        prompt_frames = [row.stream.prompt.mel.shape[1] for row in batch]
        until = [p + self.ratio * row.new_offset for p, row in zip(prompt_frames, batch)]
        caches = [row.stream.flow_cache for row in batch]
        voice = [frames_to_store(self.flow, self.flow_cache, self.prompt_cache, row.stream.prompt, cache)
                 for row, cache in zip(batch, caches)]
        mel, starts, kept, voice_caches = self._cached_solver(self.flow, conditions, caches, until,
                                                     self.flow_cache.max_frames, voice, self.map_rows)
        for row, old, cache, voice_cache in zip(batch, caches, kept, voice_caches):
            row.flow_cache = cache
            if voice_cache is not None:  # the voice's frames: right for any stream of this prompt
                self.prompt_cache.store(old.voice_key, voice_cache)
        # >= 0: the cached frames are ones already spoken (until stops at the next call's first frame).
        return mel, [start - p for start, p in zip(starts, prompt_frames)]

    def _vocode(self, rows: list[_Row], prepared: list) -> list:
        """The vocoder over each row's prepared mel, one row at a time (its stream's `vocode`; None for a row
        with no mel at all).

        A row alone, as its stream's vocoder would run it: HiFT is non-causal, so padding would change a row's
        tail, and rows of equal length batched together run other convolution kernels than one row (a
        stream's audio moved by ~1e-6 with the streams that shared its call)."""
        return [row.stream.vocoder.vocode(given, row.finalize) if given.mel.shape[2] > 0 else None
                for row, given in zip(rows, prepared)]

    def _commit(self, row: _Row, samples: int) -> None:
        row.stream.tokens = row.tokens
        row.stream.flow_cache = row.flow_cache
        row.stream.offset = row.new_offset
        if samples and row.stream.first_audio_at is None:
            row.stream.first_audio_at = self.clock()
        row.stream.audio_s += samples / self.hift.config.sampling_rate
        self._streams[row.stream_id] = row.stream  # registers a new stream, even one that ends at once
        if row.finalize:
            self._free(row.stream_id, "finalize")

    def _free(self, stream_id: str, reason: str) -> bool:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return False
        stream.vocoder.close()
        stream.tokens = []
        stream.flow_cache = None
        self._freed[reason] += 1
        return True

    def _count_flow_call(self, rows: int) -> None:
        self._flow_calls += 1
        self._flow_rows += rows
        self._last_batch = rows
        self._max_batch_seen = max(self._max_batch_seen, rows)


def _conditions_by_row(flow: TokenToMel, inputs: dict, map_rows: MapRows) -> FlowConditions:
    """`flow.conditions(**inputs)` with each row's encoder run alone, over its own tokens (no padding), by
    `map_rows` (on the rows' fixed thread count): the batched encoder's sums depend on the batch's rows and
    padded length (a stream's audio moved by up to 5e-5 with the streams beside it), a row's alone do not."""
    def row(b: int) -> FlowConditions:
        token, prompt, feat = (int(inputs[name][b]) for name in ("token_len", "prompt_token_len", "prompt_feat_len"))
        with torch.inference_mode():  # per thread: map_rows may run this in another
            return flow.conditions(
                token=inputs["token"][b:b + 1, :token], token_len=inputs["token_len"][b:b + 1],
                prompt_token=inputs["prompt_token"][b:b + 1, :prompt], prompt_token_len=inputs["prompt_token_len"][b:b + 1],
                prompt_feat=inputs["prompt_feat"][b:b + 1, :feat], prompt_feat_len=inputs["prompt_feat_len"][b:b + 1],
                embedding=inputs["embedding"][b:b + 1], streaming=inputs["streaming"][b:b + 1],
                finalize=inputs["finalize"][b:b + 1])

    rows = map_rows(row, range(inputs["token"].size(0)))
    frames = max(r.mu.size(2) for r in rows)

    def stacked(name: str) -> Tensor:  # (B, ...): frame axes padded with zeros to the longest row's
        parts = [getattr(r, name) for r in rows]
        return torch.cat([F.pad(x, (0, frames - x.size(2))) if x.dim() == 3 else x for x in parts])

    return FlowConditions(*(stacked(f.name) for f in fields(FlowConditions) if f.name != "max_out"),
                          max_out=max(r.max_out for r in rows))


def _lengths(tensors: list[Tensor]) -> Tensor:
    """(B,) lengths along dim 0, on the tensors' device."""
    return torch.tensor([t.shape[0] for t in tensors], device=tensors[0].device)
