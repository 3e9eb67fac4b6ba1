"""In-flight batching for the speech LM: one thread per scheduler decodes every live stream together.

Each loop round (gpt-fast style, over the model's static KV cache of `max_batch` slots):
1. retire cancelled streams and free their slots;
2. admit waiting requests, oldest first, into free slots; each is prefilled on its own (B = 1), since
   `step_logits` returns only the last column of a row;
3. one decode step for all live streams (B = live streams, each row at its own position and slot);
   Attention spans the cache prefix the batch uses (the highest position, rounded up to a `kv_bucket`).
   With `cuda_graphs` the step is replayed from a CUDA graph per slot-count bucket (llm/decode_graphs.py).
4. sample every row with the request's own generator, push the token to its stream, retire streams
   on a stop token, at max_len, or on error.

A bistream stream (`LLMRequest.bistream`, llm/bistream.py) is not prefilled at once: its
`BistreamPlan` says what to feed as its text arrives (`LLMStream.append_text`). Each round feeds, one stream
at a time (B = 1), the text (and prompt) segments that are due; a stream that is decoding speech joins
the batched decode step; one waiting for text sits out the round, holding its slot.

A request that arrives while others decode joins them at the next round. Sampling mirrors
`llm_generate.generate` with `torch.Generator().manual_seed(request.seed)` (same length limits, the family's
masked id before min_len: `SpeechLMConfig.min_len_masked_token`; stop tokens not yielded), so a stream's
tokens do not depend on what runs beside it. Either family: the layout (`family.LMLayout`) gives the ids.
The step's log-probs (B, V) are read to the host once per round, the round's only device -> host read:
the repetition-aware sampler needs the tokens decoded so far and a CPU generator per request, and the
tokens have to reach the host to be streamed anyway. (On a GPU, `generate` runs the sampler's softmax
and sort on the device, the scheduler on the host; the two agree up to rounding.)

This module is the scheduler; the hand-over of one stream's tokens to its consumer is `llm_stream`.
"""
from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import CosyVoiceError, InvalidInput, Unavailable
from ..messages import LLMRequest
from ..engines.cuda_graphs import Capture
from ..models.qwen2 import kv_bucket
from ..models.speech_lm import SpeechLM
from .bistream import BistreamPlan, Segment, embed_segments, new_plan
from .decode_graphs import DecodeGraphs
from .stream import LLMStream
from .sampling import GeneratorTable, RasSampler, make_generator, ras_sample_table

log = logging.getLogger(__name__)

RATE_WINDOW_S = 5.0  # LLMStats.tokens_per_s averages over this many seconds
# A stream nobody listens to yet (a first sentence) waits for a slot as if its listener had this much audio
# left: a later sentence of a stream that plays, with less lead, gets the next free slot first.
NEW_STREAM_LEAD_S = 2.0


class SchedulerUnavailable(Unavailable):
    """The scheduler takes no request now: its queue is full or it has stopped. Maps to UNAVAILABLE."""


class LLMStepError(CosyVoiceError):
    """A prefill, decode step or draw failed for this stream; the scheduler carries on. Maps to INTERNAL."""


@dataclass(frozen=True)
class LLMStats:
    active_streams: int  # streams holding a cache slot
    queued: int  # requests waiting for a slot
    last_batch_size: int  # rows of the latest decode step
    peak_batch_size: int  # most rows of any decode step since start
    tokens_total: int  # speech tokens sent since start
    tokens_per_s: float  # tokens sent in the last RATE_WINDOW_S seconds, per second
    slots_free: int


@dataclass
class _Live:
    """Scheduler-side state of a stream that holds a cache slot."""

    stream: LLMStream
    slot: int
    min_len: int
    max_len: int
    sampler: RasSampler
    generator: torch.Generator
    decoded: list[int] = field(default_factory=list)  # speech tokens sent
    pos: int = 0  # cache positions written: the next input goes here
    plan: BistreamPlan | None = None  # bistream streams only

    @property
    def history(self) -> list[int]:
        """What the sampler's repetition window reads (a bistream plan's includes fill tokens)."""
        return self.plan.history if self.plan is not None else self.decoded

    @property
    def decoding(self) -> bool:
        """True when the stream's next input is its latest speech token (it joins the decode step)."""
        return self.plan.decoding if self.plan is not None else bool(self.decoded)

    @property
    def runnable(self) -> bool:
        """True when a round has something to do for this stream."""
        if self.plan is None or self.stream.cancelled:
            return True
        return self.plan.has_input or self.stream.has_text


class LLMScheduler:
    """Batches the live streams of one SpeechLM, which the scheduler owns (its KV cache is re-allocated)."""

    def __init__(self, llm: SpeechLM, max_batch: int = 8, max_seq_len: int = 4096,
                 device: torch.device | str | None = None, max_queue: int = 64,
                 step_unit: Callable[[], AbstractContextManager] = nullcontext, cuda_graphs: bool = False,
                 graph_capture: Capture | None = None):
        """`max_seq_len` bounds the positions of one stream (prompt + speech); the model's own cache
        length bounds it too. At most `max_queue` requests wait for a slot; more are refused. Each round
        (prefills, then one decode step) runs inside `step_unit()`: the core share's LLM unit, which sets
        this thread's torch threads and waits while token2wav runs a first chunk (pipeline/threads.py).
        `cuda_graphs`: the decode step replayed from CUDA graphs per slot-count bucket (llm/decode_graphs.py;
        `decode_graphs.warm_up()` captures the first buckets); `graph_capture` replaces the CUDA capture
        (tests)."""
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_queue ({max_queue}) must be >= 1")
        self.device = torch.device(device) if device is not None else next(llm.parameters()).device
        self.llm = llm.to(self.device).eval()
        self.llm.setup_caches(max_batch + 1 if cuda_graphs else max_batch)  # + the graphs' scratch slot
        self.decode_graphs = DecodeGraphs(self.llm, max_batch, graph_capture) if cuda_graphs else None
        self.max_batch = max_batch
        self.max_seq_len = min(max_seq_len, llm.max_seq_len)
        self.max_queue = max_queue
        self.step_unit = step_unit
        # Masked while a sentence has fewer than min_len tokens out, and in a bistream's text phase: what the
        # official torch loop masks (EOS in CosyVoice2, SOS in CosyVoice3; `SpeechLMConfig.min_len_masked_token`).
        self._masked = llm.config.min_len_masked_token
        self._stop_tokens = frozenset(llm.config.stop_tokens)
        self._cond = threading.Condition()  # guards everything below; the scheduler waits on it when idle
        self._waiting: deque[LLMStream] = deque()
        self._live: dict[int, _Live] = {}  # slot -> stream; written by the scheduler thread only
        self._free_slots = list(range(max_batch - 1, -1, -1))  # pop() hands out slot 0 first
        # The sentence streams' generators and histories, one row per slot, so that a round draws every
        # row with tensor ops (llm/sampling.py). On the host beside the log-probs: a draw from the
        # device's softmax could differ from today's tokens for a seed by rounding.
        self._generators = GeneratorTable(max_batch)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_batch = 0
        self._peak_batch = 0
        self._tokens_total = 0
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic time, tokens) of recent rounds

    # ---- public API ------------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._thread is not None or self._closed:
                raise RuntimeError("an LLMScheduler starts once")
            self._thread = threading.Thread(target=self._run, name="llm-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Refuse new requests, fail every waiting and live stream with SchedulerUnavailable, join the thread."""
        self._close(SchedulerUnavailable("the LLM scheduler stopped"))
        if self._thread is not None:
            self._thread.join()

    def submit(self, request: LLMRequest) -> LLMStream:
        """Queue a request (thread-safe). Raises InvalidInput naming the bad field, SchedulerUnavailable
        when the queue is full or the scheduler has stopped."""
        self._validate(request)
        stream = LLMStream(request, wake=self._wake)
        stream.deadline = time.monotonic() + (NEW_STREAM_LEAD_S if request.lead_s is None else request.lead_s)
        with self._cond:
            if self._closed:
                raise SchedulerUnavailable("the LLM scheduler has stopped")
            if len(self._waiting) >= self.max_queue:
                raise SchedulerUnavailable(f"the LLM request queue is full ({self.max_queue} waiting)")
            self._waiting.append(stream)
            self._cond.notify()
        return stream

    @property
    def stats(self) -> LLMStats:
        with self._cond:
            self._forget_old_rounds(time.monotonic())
            return LLMStats(active_streams=len(self._live), queued=len(self._waiting),
                            last_batch_size=self._last_batch, peak_batch_size=self._peak_batch,
                            tokens_total=self._tokens_total,
                            tokens_per_s=sum(n for _, n in self._recent) / RATE_WINDOW_S,
                            slots_free=len(self._free_slots))

    # ---- validation (caller's thread) ------------------------------------------------------------

    def _validate(self, request: LLMRequest) -> None:
        """What only this model can check (its vocabularies, its cache); the rest was checked where the request
        entered the process (the llm model's parse, the pipeline's request)."""
        config = self.llm.config
        _check_ids("text_tokens", request.text_tokens, config.qwen.vocab_size)
        _check_ids("prompt_text_tokens", request.prompt_text_tokens, config.qwen.vocab_size)
        _check_ids("prompt_speech_tokens", request.prompt_speech_tokens, config.speech_token_size)
        if not request.text_tokens and not request.bistream:
            raise InvalidInput("text_tokens", "is empty")
        # The official CosyVoice3 LM asserts <|endofprompt|> in prompt text ++ text (bistream: in the prompt text).
        given = request.prompt_text_tokens if request.bistream else [*request.prompt_text_tokens, *request.text_tokens]
        self.llm.check_required_text(list(given), "prompt_text_tokens")
        prompt_len = _prompt_len(request)
        if prompt_len >= self.max_seq_len:
            raise InvalidInput("text_tokens", f"the prompt takes {prompt_len} positions (text "
                                              f"{len(request.text_tokens)}, prompt text "
                                              f"{len(request.prompt_text_tokens)}, prompt speech "
                                              f"{len(request.prompt_speech_tokens)}); the cache holds "
                                              f"{self.max_seq_len}")

    # ---- the scheduler thread -----------------------------------------------------------------------

    def _run(self) -> None:
        error: Exception = SchedulerUnavailable("the LLM scheduler stopped")
        try:
            self._loop()
        except Exception as exc:  # a fault of the loop itself: fail every stream rather than leave it hanging
            log.exception("the LLM scheduler loop failed")
            error = LLMStepError(f"the LLM scheduler failed: {exc}")
            error.__cause__ = exc
        finally:
            self._close(error)
            with self._cond:
                for live in list(self._live.values()):
                    self._release(live)

    @torch.inference_mode()
    def _loop(self) -> None:
        while self._wait_for_work():
            self._drop_cancelled()
            with self.step_unit():
                self._admit()
                self._feed_bistreams()
                self._decode()

    def _wait_for_work(self) -> bool:
        """Block while there is nothing to do (bistream streams waiting for text do nothing); False once
        the scheduler is closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._waiting
                                or any(live.runnable for live in self._live.values()))
            return not self._closed

    def _wake(self) -> None:
        """A stream has news (text appended, its end, a cancel): look again."""
        with self._cond:
            self._cond.notify()

    def _close(self, error: Exception) -> None:
        """Refuse new requests and fail every stream not yet finished (the scheduler frees the slots)."""
        with self._cond:
            self._closed = True
            streams = [live.stream for live in self._live.values()] + list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for stream in streams:
            stream._finish("error", error)

    def _drop_cancelled(self) -> None:
        with self._cond:
            waiting = [stream for stream in self._waiting if stream.cancelled]
            if waiting:
                self._waiting = deque(stream for stream in self._waiting if not stream.cancelled)
        for stream in waiting:
            stream._finish("cancelled")
        for live in [live for live in self._live.values() if live.stream.cancelled]:
            self._retire(live, "cancelled")

    def _admit(self) -> None:
        """Move waiting requests into free slots, the earliest deadline first (the oldest among equals: a
        sentence whose listener has the least audio left before new streams), and prefill each."""
        while True:
            with self._cond:
                if not self._waiting or not self._free_slots:
                    return
                first = min(range(len(self._waiting)), key=lambda i: (self._waiting[i].deadline, i))
                stream = self._waiting[first]
                del self._waiting[first]
                live = self._new_live(stream, self._free_slots.pop())
                self._live[live.slot] = live
            if live.plan is None:
                self._prefill(live)

    def _new_live(self, stream: LLMStream, slot: int) -> _Live:
        request = stream.request
        if request.bistream:  # min_len: none (as the official bistream); max_len: the plan's and the cache's
            plan = new_plan(self.llm, request.prompt_text_tokens, request.prompt_speech_tokens)
            plan.add_text(request.text_tokens)
            return _Live(stream=stream, slot=slot, min_len=0, max_len=self.max_seq_len,
                         sampler=RasSampler(request.sampling), generator=make_generator(request.seed), plan=plan)
        min_len, max_len = self.llm.length_limits(len(request.text_tokens))
        prompt_len = _prompt_len(request)
        generator = make_generator(request.seed)
        self._generators.load(slot, generator, request.sampling.win_size)  # the table draws for it from now on
        return _Live(stream=stream, slot=slot, min_len=min_len,
                     max_len=min(max_len, self.max_seq_len - prompt_len),
                     sampler=RasSampler(request.sampling), generator=generator)

    def _prefill(self, live: _Live) -> None:
        request, device = live.stream.request, self.device
        try:
            x = self.llm.build_prompt(_ids(request.text_tokens, device), _ids(request.prompt_text_tokens, device),
                                      _ids(request.prompt_speech_tokens, device))  # (1, L, D)
            prompt_len = x.shape[1]
            input_pos = torch.arange(prompt_len, device=device)[None]  # (1, L)
            kv_len = kv_bucket(prompt_len, self.llm.max_seq_len)
            logits = self.llm.step_logits(x, input_pos, torch.tensor([live.slot], device=device), kv_len)  # (1, V)
            logp = _host_log_probs(logits)  # (1, V)
        except Exception as exc:
            self._fail([live], "prefill", exc)
            return
        live.pos = prompt_len
        self._sample([live], logp)

    def _feed_bistreams(self) -> None:
        """Feed each bistream stream that is not decoding the segments now due (B = 1 each)."""
        for live in [live for live in self._live.values() if live.plan is not None and not live.decoding]:
            tokens, ended = live.stream._take_text()
            try:
                if tokens:
                    live.plan.add_text(tokens)
                if ended:
                    live.plan.end_text()
                feed = live.plan.next_feed()
            except Exception as exc:
                self._fail([live], "bistream text", exc)
                continue
            if feed is not None:
                self._feed(live, feed)

    def _feed(self, live: _Live, feed: list[Segment]) -> None:
        """Prefill one bistream stream's due segments at its next positions, then draw."""
        length = sum(len(segment) for segment in feed)
        if live.pos + length > self.max_seq_len:
            self._retire(live, "max_len")
            return
        device = self.device
        try:
            x = embed_segments(self.llm, feed, device)  # (1, L, D)
            input_pos = torch.arange(live.pos, live.pos + length, device=device)[None]  # (1, L)
            kv_len = kv_bucket(live.pos + length, self.llm.max_seq_len)
            logits = self.llm.step_logits(x, input_pos, torch.tensor([live.slot], device=device), kv_len)  # (1, V)
            logp = _host_log_probs(logits)  # (1, V)
        except Exception as exc:
            self._fail([live], "bistream feed", exc)
            return
        live.pos += length
        self._sample([live], logp)

    def _decode(self) -> None:
        """One step for every decoding stream: row b feeds its latest token at its own position and slot."""
        for live in [live for live in self._live.values() if live.decoding and live.pos >= self.max_seq_len]:
            self._retire(live, "max_len")  # a bistream stream whose cache is full
        batch = [live for live in self._live.values() if live.decoding]
        if not batch:
            return
        device = self.device
        try:
            tokens = torch.tensor([[live.history[-1]] for live in batch], device=device)  # (B, 1)
            input_pos = torch.tensor([[live.pos] for live in batch], device=device)  # (B, 1)
            slots = torch.tensor([live.slot for live in batch], device=device)  # (B,)
            kv_len = kv_bucket(max(live.pos for live in batch) + 1, self.llm.max_seq_len)
            if self.decode_graphs is not None:
                logits = self.decode_graphs.step(tokens, input_pos, slots, kv_len)  # (B, V)
            else:
                logits = self.llm.step_logits(self.llm.embed_speech(tokens), input_pos, slots, kv_len)  # (B, V)
            logp = _host_log_probs(logits)  # (B, V)
        except Exception as exc:
            self._fail(batch, "decode step", exc)
            return
        for live in batch:
            live.pos += 1
        with self._cond:
            self._last_batch = len(batch)
            self._peak_batch = max(self._peak_batch, len(batch))
        self._sample(batch, logp)

    def _sample(self, batch: Sequence[_Live], logp: Tensor) -> None:
        """Draw one token per row of the host log-probs (B, V), as `llm_generate.generate` does (a bistream
        stream as `bistream.generate_bistream`); deliver it."""
        sent = 0
        for live, token in zip(batch, self._draw(batch, logp)):
            if isinstance(token, Exception):
                self._fail([live], "sampling", token)
                continue
            outcome = live.plan.accept(token) if live.plan is not None else \
                ("stop" if token in self._stop_tokens else "speech")
            if outcome == "stop":
                self._retire(live, "stop_token")
                continue
            if outcome == "fill":  # a bistream stream waits for its next 5 text tokens
                continue
            live.decoded.append(token)
            live.stream._push(token)
            sent += 1
            if len(live.decoded) >= live.max_len or (live.plan is not None and live.plan.at_max_len):
                self._retire(live, "max_len")
        self._count(sent)

    def _draw(self, batch: Sequence[_Live], logp: Tensor) -> list[int | Exception]:
        """A token per row of logp (B, V), or the error that stopped its draw: the sentence rows drawn
        together, the bistream rows one at a time."""
        tokens: list[int | Exception] = [0] * len(batch)
        sentences = [b for b, live in enumerate(batch) if live.plan is None]
        if sentences:
            rows = logp if len(sentences) == len(batch) else logp[sentences]  # (S, V)
            drawn = self._draw_sentences([batch[b] for b in sentences], rows)
            for b, token in zip(sentences, drawn):
                tokens[b] = token
        for b, live in enumerate(batch):
            if live.plan is not None:
                try:
                    tokens[b] = _draw_bistream(live, logp[b], self._masked)
                except Exception as exc:
                    tokens[b] = exc
        return tokens

    def _draw_sentences(self, batch: Sequence[_Live], logp: Tensor) -> list[int | Exception]:
        """logp (B, V): the masked id is banned in the rows with fewer than min_len tokens out (the other stop
        tokens stay allowed). A fault of the whole batch's draw fails every row."""
        short = [b for b, live in enumerate(batch) if len(live.decoded) < live.min_len]
        if short:
            logp[short, self._masked] = -math.inf
        try:
            return ras_sample_table(logp, [live.sampler.params for live in batch], self._generators,
                                    [live.slot for live in batch])
        except Exception as exc:
            return [exc] * len(batch)

    def _fail(self, batch: Sequence[_Live], stage: str, exc: Exception) -> None:
        ids = ", ".join(live.stream.request.stream_id for live in batch)
        log.error("LLM %s failed for request(s) %s", stage, ids, exc_info=exc)
        for live in batch:
            error = LLMStepError(f"the LLM {stage} failed for request {live.stream.request.stream_id}: {exc}")
            error.__cause__ = exc
            self._retire(live, "error", error)

    def _retire(self, live: _Live, reason: str, error: Exception | None = None) -> None:
        """Free the slot first, so a consumer that sees the end also sees the slot free."""
        with self._cond:
            self._release(live)
        live.stream._finish(reason, error)

    def _release(self, live: _Live) -> None:
        """Give the slot back; hold self._cond. Stale cache rows need no clearing: a new stream writes
        from position 0 up and attends only to positions <= its own."""
        del self._live[live.slot]
        self._free_slots.append(live.slot)

    def _count(self, tokens: int) -> None:
        now = time.monotonic()
        with self._cond:
            self._tokens_total += tokens
            self._recent.append((now, tokens))
            self._forget_old_rounds(now)

    def _forget_old_rounds(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()


def _draw_bistream(live: _Live, logp: Tensor, masked: int) -> int:
    """logp (V,): the plan's forced fill token, or a draw with `masked` banned until the text has ended."""
    forced = live.plan.forced_token()
    if forced is not None:
        return forced
    if live.plan.ban_eos:
        logp[masked] = -math.inf
    return live.sampler(logp, live.plan.history, live.generator)


def _host_log_probs(logits: Tensor) -> Tensor:
    """Log-probs of logits (B, V) on the host: the round's one device -> host read."""
    return logits.log_softmax(dim=-1).cpu()


def _prompt_len(request: LLMRequest) -> int:
    """Positions of the prefill: sos, prompt text, text, task id, prompt speech."""
    return 2 + len(request.prompt_text_tokens) + len(request.text_tokens) + len(request.prompt_speech_tokens)


def _ids(tokens: list[int], device: torch.device) -> Tensor:
    return torch.tensor(tokens, dtype=torch.int64, device=device).reshape(1, -1)  # (1, N)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_ids(name: str, tokens: object, limit: int) -> None:
    if not isinstance(tokens, (list, tuple)) or not all(_is_int(t) for t in tokens):
        raise InvalidInput(name, "must be a list of integer ids")
    if tokens and (min(tokens) < 0 or max(tokens) >= limit):
        raise InvalidInput(name, f"ids must lie in [0, {limit})")
