"""Bistream text input: the speech LM reads the text as it arrives, in the trained 5:15 pattern.

Both families were trained on sequences that interleave 5 text tokens with 15 speech tokens, each group of
speech tokens closed by the fill token (codebook + `LMLayout.fill`: 6563 in CosyVoice2, 6564 in CosyVoice3).
Decoding in that pattern lets speech start before the text is complete (the official
`Qwen2LM.inference_bistream`, which `CosyVoice3LM` inherits):

1. The input starts with sos. CosyVoice3 then takes the prompt text up to its `<|endofprompt|>` (the system
   prompt or the instruction: `LMLayout.required_text_id`) as it is, right after sos. The rest of the prompt
   text (the transcript) is the first text; each 5 text tokens are laid out with the next 15 prompt speech
   tokens, until the prompt speech is used up (the prompt speech is always at least 3x its transcript, so
   this waits for text of the request).
2. Then speech is decoded until a fill token: sampled, or forced once 15 speech tokens follow the previous
   fill. After a fill, the next 5 text tokens are fed and decoding goes on. While the text goes on, the id
   the official loop masks is masked (`SpeechLMConfig.min_len_masked_token`: EOS in CosyVoice2, SOS in
   CosyVoice3, as its `ignore_eos` does).
3. Once the text has ended: the text not yet fed, the task id (and any prompt speech not yet laid out, after
   it, as in training) are fed and speech is decoded until a stop token, as in the one-shot layout.

`BistreamPlan` decides what to feed, from the text tokens read so far; it reads arrived tokens one at a
time, as the official loop does with the one-token pieces its frontend yields, so what is fed depends only
on the token sequence, never on how the text was cut into pieces or when they came: the same seed gives
the same speech however fast the text arrives. The LLM scheduler (`llm_scheduler`) runs a plan per
bistream stream among its batched streams; `generate_bistream` is the single-stream reference.

Three official slips are not copied: after a fill the official final step feeds its last input a second time
(it is already in the cache); it drops prompt speech not yet laid out when the text is short; and with
CosyVoice3's head and no prompt speech (cross_lingual, instruct2) it decodes speech before any text is fed
(its check for "nothing laid out yet" looks for sos alone): here the head waits for the first 5 text tokens
as sos alone does.
Where the official code raises (a stop token other than the fill sampled before the text ended, or a
non-EOS stop token after it), the stream ends as on a stop token.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..family import COSYVOICE2
from ..messages import SamplingParams
from ..models.qwen2 import kv_bucket
from ..models.speech_lm import SpeechLM
from .sampling import RasSampler, make_generator

MIX_TEXT, MIX_SPEECH = 5, 15  # the trained pattern: 5 text tokens, then 15 speech tokens and a fill token


@dataclass(frozen=True)
class Segment:
    """A run of LLM input positions of one kind: sos | task_id (one position each) | text | speech (ids)."""

    kind: str
    ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return 1 if self.kind in ("sos", "task_id") else len(self.ids)


SOS = Segment("sos")
TASK_ID = Segment("task_id")


class BistreamPlan:
    """What one bistream stream feeds the LLM next, and what its outputs mean. Not thread-safe: one owner.

    The driver loop: `feed = next_feed()` (None: wait for text: `add_text` / `end_text`), one forward of
    `feed`, then `token = forced_token()` or a draw from the step's log-probs (the masked id banned while
    `ban_eos`) over `history`, and `accept(token)` says "speech" (send it), "fill" or "stop".
    `head_end_id`: the prompt text up to and including this id is fed right after sos (CosyVoice3's
    `<|endofprompt|>`; None: no head). `fill_token` None: CosyVoice2's."""

    def __init__(self, prompt_text_tokens: Sequence[int], prompt_speech_tokens: Sequence[int],
                 speech_token_size: int, max_token_text_ratio: float, fill_token: int | None = None,
                 head_end_id: int | None = None):
        self.speech_token_size = speech_token_size
        self.fill_token = speech_token_size + COSYVOICE2.lm.fill if fill_token is None else fill_token
        self.max_token_text_ratio = max_token_text_ratio
        self.history: list[int] = []  # every output, fill tokens included (the sampler's window sees them)
        self.text_len = 0  # text tokens received (the prompt transcript excluded)
        self.speech_out = 0  # speech tokens accepted
        self.final = False  # the text has ended and is all fed: decode until a stop token
        self.decoding = False  # the last output is a speech token, to be fed next
        self._arrived: deque[int] = deque()  # text tokens received, not yet read
        self._text_ended = False
        prompt_text = list(prompt_text_tokens)
        head = prompt_text.index(head_end_id) + 1 if head_end_id in prompt_text else 0
        self._text: list[int] = prompt_text[head:]  # text read, not yet fed
        self._prompt_speech: list[int] = list(prompt_speech_tokens)  # not yet laid out
        # Laid out, not yet fed; the start is what the model reads before any text.
        self._start = [SOS] + ([Segment("text", tuple(prompt_text[:head]))] if head else [])
        self._pending: list[Segment] = list(self._start)
        given = len(self._prompt_speech)  # the first fill comes where the prompt's last group of 15 ends
        self._next_fill = (given // MIX_SPEECH + 1) * MIX_SPEECH - given

    # ---- text in ---------------------------------------------------------------------------------------

    def add_text(self, tokens: Iterable[int]) -> None:
        if self._text_ended:
            raise ValueError("the text has ended")
        tokens = list(tokens)
        self._arrived.extend(tokens)
        self.text_len += len(tokens)

    def end_text(self) -> None:
        self._text_ended = True

    @property
    def has_input(self) -> bool:
        """True when `next_feed` may have something without more text."""
        return self.decoding or bool(self._arrived) or (self._text_ended and not self.final)

    # ---- the loop ----------------------------------------------------------------------------------------

    @property
    def ban_eos(self) -> bool:
        return not self.final

    def next_feed(self) -> list[Segment] | None:
        """The segments to feed now, or None until more text (or its end) arrives."""
        if self.decoding:
            return [Segment("speech", (self.history[-1],))]
        if self.final:
            raise RuntimeError("a bistream plan that has stopped feeds nothing")
        while self._arrived:
            self._text.append(self._arrived.popleft())
            feed = self._read_one()
            if feed is not None:
                return feed
        if not self._text_ended:
            return None
        self.final = True
        rest = [Segment("text", tuple(self._text))] if self._text else []
        speech = [Segment("speech", tuple(self._prompt_speech))] if self._prompt_speech else []
        self._text, self._prompt_speech = [], []
        return self._take_pending() + rest + [TASK_ID] + speech

    def forced_token(self) -> int | None:
        """The fill token when 15 speech tokens follow the previous fill (text phase only), else None."""
        if not self.final and len(self.history) == self._next_fill:
            return self.fill_token
        return None

    def accept(self, token: int) -> str:
        """Record the step's output: "speech" (a speech token to send), "fill" or "stop"."""
        if not self.final and token == self.fill_token:
            self._next_fill = len(self.history) + MIX_SPEECH + 1
            self.history.append(token)
            self.decoding = False
            return "fill"
        if token >= self.speech_token_size:
            self.decoding = False
            return "stop"
        self.history.append(token)
        self.speech_out += 1
        self.decoding = True
        return "speech"

    @property
    def max_len(self) -> int | None:
        """Most speech tokens once the text has ended (the one-shot limit of its length), else None."""
        return int(self.text_len * self.max_token_text_ratio) if self._text_ended else None

    @property
    def at_max_len(self) -> bool:
        limit = self.max_len
        return limit is not None and self.speech_out >= limit

    # ---- helpers -----------------------------------------------------------------------------------------

    def _read_one(self) -> list[Segment] | None:
        """After reading one more text token: lay out prompt speech, or feed 5 text tokens when due."""
        while self._prompt_speech and len(self._text) >= MIX_TEXT:
            self._pending += [Segment("text", tuple(self._text[:MIX_TEXT])),
                              Segment("speech", tuple(self._prompt_speech[:MIX_SPEECH]))]
            del self._text[:MIX_TEXT], self._prompt_speech[:MIX_SPEECH]
        if self._prompt_speech:
            return None
        if not self.history and self._pending != self._start:  # the prompt is laid out: decode before more text
            return self._take_pending()
        if len(self._text) >= MIX_TEXT:  # at the start, or after a fill
            self._pending.append(Segment("text", tuple(self._text[:MIX_TEXT])))
            del self._text[:MIX_TEXT]
            return self._take_pending()
        return None

    def _take_pending(self) -> list[Segment]:
        pending, self._pending = self._pending, []
        return pending


def embed_segments(llm: SpeechLM, segments: Sequence[Segment], device: torch.device) -> Tensor:
    """LLM input embeddings of the segments, in order: (1, L, D)."""
    layout = llm.config.layout
    parts = []
    for segment in segments:
        if segment.kind == "sos":
            parts.append(llm.special_embedding(layout.sos))  # (1, 1, D)
        elif segment.kind == "task_id":
            parts.append(llm.special_embedding(layout.task_id))  # (1, 1, D)
        else:
            ids = torch.tensor(segment.ids, dtype=torch.int64, device=device).reshape(1, -1)  # (1, N)
            embed = llm.backbone.embed_tokens if segment.kind == "text" else llm.speech_embedding
            parts.append(embed(ids))  # (1, N, D)
    return torch.cat(parts, dim=1)


def new_plan(llm: SpeechLM, prompt_text_tokens: Sequence[int], prompt_speech_tokens: Sequence[int]) -> BistreamPlan:
    config = llm.config
    return BistreamPlan(prompt_text_tokens, prompt_speech_tokens, config.speech_token_size,
                        config.max_token_text_ratio, config.fill_token, config.layout.required_text_id)


@torch.inference_mode()
def generate_bistream(llm: SpeechLM, text_pieces: Iterable[Sequence[int]], prompt_text_tokens: Sequence[int],
                      prompt_speech_tokens: Sequence[int], sampling: SamplingParams | None = None,
                      generator: torch.Generator | None = None, slot: int = 0) -> Iterator[int]:
    """Speech tokens of one bistream stream in cache slot `slot`: the reference that `LLMScheduler` batches.

    `text_pieces` yields lists of text token ids; a piece is read only when the plan needs more text, so a
    generator that waits for its text (an LLM writing it) is consumed as the speech goes on. Ends at a stop
    token, at the length limit of the whole text, or when the cache is full."""
    sampling = (llm.config.sampling if sampling is None else sampling).validate()
    llm.check_required_text(list(prompt_text_tokens), "prompt_text_tokens")
    sampler = RasSampler(sampling)
    generator = generator if generator is not None else make_generator(sampling.seed)
    device = llm.llm_decoder.weight.device
    plan = new_plan(llm, prompt_text_tokens, prompt_speech_tokens)
    pieces = iter(text_pieces)
    slots = torch.tensor([slot], device=device)
    pos = 0  # cache positions written
    banned = llm.config.min_len_masked_token  # what the official text phase masks
    while not plan.at_max_len:
        feed = plan.next_feed()
        if feed is None:
            piece = next(pieces, None)
            plan.end_text() if piece is None else plan.add_text(piece)
            continue
        x = embed_segments(llm, feed, device)  # (1, L, D)
        if pos + x.shape[1] > llm.max_seq_len:
            return
        input_pos = torch.arange(pos, pos + x.shape[1], device=device)[None]  # (1, L)
        pos += x.shape[1]
        logp = llm.step_logits(x, input_pos, slots, kv_bucket(pos, llm.max_seq_len))[0].log_softmax(dim=-1)  # (V,)
        token = plan.forced_token()
        if token is None:
            if plan.ban_eos:
                logp[banned] = -math.inf
            token = sampler(logp, plan.history, generator)
        outcome = plan.accept(token)
        if outcome == "stop":
            return
        if outcome == "speech":
            yield token
