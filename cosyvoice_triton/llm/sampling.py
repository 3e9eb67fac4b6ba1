"""Repetition-aware sampling (RAS) of speech tokens, as CosyVoice2 does it, with a per-request generator.

One draw: take the smallest head of the probability-sorted vocabulary whose mass reaches `top_p`, at
most `top_k` tokens, and draw from it. If the drawn token already occurs at least `win_size * tau_r`
times among the last `win_size` decoded tokens, ban it and draw again from the whole distribution.

The operations and their order follow the official `ras_sampling` in `cosyvoice/utils/common.py`
(stable descending sort, float32 running sum of the head, one multinomial draw per step), so a
generator seeded with s draws the same tokens as the official code after `torch.manual_seed(s)` on the
CPU. Every request owns its `torch.Generator`: its draws never depend on other requests. Draws run on
the generator's device; a CPU generator (the default) makes them independent of the model's device.

`ras_sample` draws for a whole batch of rows at once (the scheduler's decode round): the softmax, the
sort, the head sizes and the draw from the heads are tensor ops over the batch; each row still draws
its noise from its own generator, so a row's tokens are those it would get alone.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from cosyvoice_triton.messages import SamplingParams  # noqa: F401 - the message lives there


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator of its own for one request: seeded with `seed`, or from fresh entropy when None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class Sampler(Protocol):
    def __call__(self, logp: Tensor, decoded: Sequence[int], generator: torch.Generator | None) -> int:
        """Pick the next token from log-probs `logp` (V,) given the tokens decoded so far."""


def full_sample(logp: Tensor, generator: torch.Generator | None) -> int:
    """Draw from the whole distribution of logp (V,)."""
    return draw(logp.softmax(dim=0), generator)


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One index drawn in proportion to probs (N,), on the generator's device (so a CPU generator
    serves a model on any device and gives the same draws)."""
    if generator is not None:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, replacement=True, generator=generator))


class RasSampler:
    """The official repetition-aware sampler bound to one SamplingParams: `ras_sample` for one row."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()

    def __call__(self, logp: Tensor, decoded: Sequence[int], generator: torch.Generator | None) -> int:
        [token] = ras_sample(logp[None], [self.params], [decoded], [generator])
        if isinstance(token, Exception):
            raise token
        return token


def ras_sample(logp: Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
               generators: Sequence[torch.Generator | None]) -> list[int | Exception]:
    """One repetition-aware draw per row of logp (B, V): row b with the validated params[b], the tokens
    histories[b] decoded so far and its own generators[b] (all on one device, or None for torch's
    default generator). Only the repetition check and its rare re-draw run row by row.

    Row b gets the token the official `ras_sampling` draws after `torch.manual_seed(seed)` for a
    generator seeded with seed, or, where its draw fails (log-probs with NaN or no finite entry), the
    exception; the other rows' draws are unaffected. Of a logp on a GPU only the heads (B, top_k) are
    read to the host (for the running sum); the draw itself runs on the generators' device.
    """
    probs, token_ids = logp.softmax(dim=-1).sort(dim=-1, descending=True, stable=True)  # (B, V), (B, V)
    width = min(max(p.top_k for p in params), logp.shape[-1])
    device = _generator_device(generators, logp.device)
    head = probs[:, :width].to(device)  # (B, K)
    sizes, valid = _head_sizes(head, params)
    picks = _draw_heads(head, sizes, valid, generators)  # (B,) positions in the heads
    firsts = token_ids[:, :width].to(device).gather(1, picks[:, None])[:, 0].tolist()
    tokens: list[int | Exception] = []
    for b, token in enumerate(firsts):
        if not valid[b]:
            tokens.append(ValueError("the log-probs hold no distribution to draw from (NaN or no finite entry)"))
            continue
        try:
            tokens.append(_unrepeated(logp[b], token, params[b], histories[b], generators[b]))
        except Exception as exc:  # the re-draw found nothing to draw from
            tokens.append(exc)
    return tokens


def _generator_device(generators: Sequence[torch.Generator | None], default: torch.device) -> torch.device:
    """Where the batch draws: its generators' one device (the logp's when every generator is None)."""
    devices = {generator.device for generator in generators if generator is not None}
    if len(devices) > 1:
        raise ValueError(f"a batch draws on one device; its generators are on {sorted(map(str, devices))}")
    return devices.pop() if devices else default


def _head_sizes(head: Tensor, params: Sequence[SamplingParams]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens in each row's nucleus, for the sorted probabilities head (B, K), and whether that nucleus
    is a distribution to draw from: (B,) ints, (B,) bools.

    A token joins the head while the mass before it is below top_p and fewer than top_k have joined.
    The sum runs sequentially in float32 along each row, as the official loop does; numpy's cumsum
    does that (torch's accumulates in float64).
    """
    values = head.cpu().numpy()  # (B, K)
    running = np.cumsum(values, axis=1, dtype=np.float32)  # (B, K)
    mass_before = np.concatenate([np.zeros_like(running[:, :1]), running[:, :-1]], axis=1)  # (B, K)
    top_p = np.array([p.top_p for p in params], dtype=np.float32)[:, None]  # (B, 1)
    top_k = np.array([p.top_k for p in params])[:, None]  # (B, 1)
    in_head = (mass_before < top_p) & (np.arange(values.shape[1]) < top_k)  # (B, K)
    kept = np.where(in_head, values, 0)  # (B, K)
    # torch.multinomial's own checks: finite, non-negative, a positive sum.
    valid = np.isfinite(kept).all(axis=1) & (kept >= 0).all(axis=1) & (kept.sum(axis=1) > 0)
    return in_head.sum(axis=1), valid


def _draw_heads(head: Tensor, sizes: np.ndarray, valid: np.ndarray,
                generators: Sequence[torch.Generator | None]) -> Tensor:
    """Position drawn in each row of head (B, K) among its first sizes[b], as
    `torch.multinomial(head[b, :sizes[b]], 1, replacement=True, generator=generators[b])` draws it -> (B,).

    For one sample torch takes argmax(p / q) with q = empty_like(p).exponential_(1, generator) (the
    fast path of its multinomial; tests/test_llm_sampling.py checks it against torch.multinomial). So
    each valid row fills its q from its own generator, exactly sizes[b] long (what a generator yields
    depends on that length), and the division and argmax run on the whole batch. Invalid rows draw
    nothing (torch.multinomial refuses them before it draws).
    """
    width = head.shape[1]
    noise = torch.ones_like(head)  # (B, K)
    for b, (size, generator) in enumerate(zip(sizes.tolist(), generators)):
        if valid[b]:
            noise[b, :size].exponential_(1, generator=generator)
    in_head = torch.arange(width, device=head.device) < torch.as_tensor(sizes * valid, device=head.device)[:, None]
    return torch.where(in_head, head / noise, -1).argmax(dim=1)  # (B,)


def _unrepeated(logp: Tensor, token: int, params: SamplingParams, history: Sequence[int],
                generator: torch.Generator | None) -> int:
    """`token`, unless it already occurs win_size * tau_r times among the last win_size of history: then a
    draw from the whole distribution of logp (V,) with that token banned."""
    repeats = list(history[-params.win_size:]).count(token)
    if repeats < params.win_size * params.tau_r:
        return token
    banned = logp.clone()
    banned[token] = -math.inf
    return full_sample(banned, generator)


# ---- every row's draw in tensor ops: the generators' Mersenne Twisters stacked ---------------------------
#
# A torch CPU generator is a 32-bit Mersenne Twister (MT19937). `exponential_` on a float tensor on the CPU
# takes, per element, one 64-bit word (two 32-bit outputs, the first the high half), keeps its low 53 bits
# as u in [0, 1) and returns float(-log1p(-u)) computed in double. GeneratorTable keeps the twister states of
# a scheduler's slots in one (slots, 624) tensor, so a round draws every row's noise with the same tensor
# ops, on any device, and each row gets the numbers its own generator would have given.
# (tests/test_batched_sampling.py checks both against torch, draw for draw.)

MT_N, MT_M = 624, 397
_UPPER, _LOWER, _MATRIX_A = 0x80000000, 0x7FFFFFFF, 0x9908B0DF
_STATE_AT, _LEFT_AT, _NEXT_AT = 24, 8, 16  # byte offsets in a CPU generator's get_state()


def _twist(state: Tensor) -> Tensor:
    """The next twister arrays of state (B, 624) int64 words, as MT19937's next_state computes them."""
    old, new = state, state.clone()

    def mix(upper: Tensor, lower: Tensor, far: Tensor) -> Tensor:
        y = (upper & _UPPER) | (lower & _LOWER)
        return far ^ (y >> 1) ^ ((lower & 1) * _MATRIX_A)

    # Word k reads words k + 1 and k + 397 (mod 624); the ones past the end were already renewed.
    new[:, :227] = mix(old[:, :227], old[:, 1:228], old[:, MT_M:])
    new[:, 227:454] = mix(old[:, 227:454], old[:, 228:455], new[:, :227])
    new[:, 454:623] = mix(old[:, 454:623], old[:, 455:624], new[:, 227:396])
    new[:, 623:] = mix(old[:, 623:], new[:, :1], new[:, 396:397])
    return new


def _temper(y: Tensor) -> Tensor:
    y = y ^ (y >> 11)
    y = y ^ ((y << 7) & 0x9D2C5680)
    y = y ^ ((y << 15) & 0xEFC60000)
    return y ^ (y >> 18)


class GeneratorTable:
    """Per slot: the Mersenne Twister state of a torch CPU generator and the tokens drawn lately, stacked on
    `device`, so that one round draws for every row in tensor ops.

    load(slot, generator, win_size) copies a request's generator in (at admission) and empties the slot's
    history; from then on the table is that row's generator: exponential() advances it as exponential_
    would advance the generator, and store() copies it back out.
    """

    def __init__(self, slots: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.state = torch.zeros(slots, MT_N, dtype=torch.int64, device=self.device)  # (S, 624) uint32 words
        self.used = torch.full((slots,), MT_N, dtype=torch.int64, device=self.device)  # (S,) words drawn of it
        self.next = torch.zeros(slots, dtype=torch.int64, device=self.device)  # (S,) the twister's own index
        self.recent = torch.full((slots, 1), -1, dtype=torch.int64, device=self.device)  # (S, W) newest last

    def load(self, slot: int, generator: torch.Generator, win_size: int) -> None:
        if generator.device.type != "cpu":
            raise ValueError("a GeneratorTable copies CPU generators (torch's Mersenne Twister)")
        raw = generator.get_state().numpy().tobytes()
        words = np.frombuffer(raw, dtype=np.uint64, count=MT_N, offset=_STATE_AT).astype(np.int64)
        left = int(np.frombuffer(raw, dtype=np.int32, count=1, offset=_LEFT_AT)[0])
        self.state[slot] = torch.from_numpy(words).to(self.device)
        self.used[slot] = MT_N + 1 - left  # a fresh seed has left 1: its first draw twists
        self.next[slot] = int(np.frombuffer(raw, dtype=np.uint64, count=1, offset=_NEXT_AT)[0])  # used, or 0 if fresh
        if win_size > self.recent.shape[1]:  # widen on the left: the rows' newest tokens stay last
            wider = torch.full((len(self.recent), win_size - self.recent.shape[1]), -1, dtype=torch.int64,
                               device=self.device)
            self.recent = torch.cat([wider, self.recent], dim=1)
        self.recent[slot] = -1

    def store(self, slot: int, generator: torch.Generator) -> None:
        """Write the row's twister into `generator` (its seed and cached normal sample kept)."""
        raw = bytearray(generator.get_state().numpy().tobytes())
        used = int(self.used[slot])
        raw[_STATE_AT:_STATE_AT + 8 * MT_N] = self.state[slot].cpu().numpy().astype(np.uint64).tobytes()
        raw[_LEFT_AT:_LEFT_AT + 4] = np.int32(MT_N + 1 - used).tobytes()
        raw[_NEXT_AT:_NEXT_AT + 8] = np.uint64(int(self.next[slot])).tobytes()
        generator.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())

    def exponential(self, rows: Tensor, counts: Tensor, width: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Exp(1) noise (B, width): row b's first counts[b] entries drawn from slot rows[b] as
        `torch.empty(counts[b]).exponential_(1, generator)` draws them, the rest 1 (nothing drawn for them)."""
        if not len(rows):
            return torch.ones(0, width, dtype=dtype, device=self.device)
        state, used = self.state[rows], self.used[rows]  # (B, 624), (B,)
        words = 2 * counts  # (B,) two 32-bit outputs per number
        end = used + words  # (B,) where each row's draw ends, in words from its current array's start
        twists = torch.where(words > 0, (end - 1).div(MT_N, rounding_mode="floor"), 0)  # (B,) arrays renewed
        arrays = [state]
        for _ in range(int(twists.max())):
            arrays.append(_twist(arrays[-1]))
        stacked = torch.cat(arrays, dim=1)  # (B, 624 * (1 + most twists))
        offsets = torch.arange(2 * width, device=self.device)  # (2K,)
        raw = _temper(stacked.gather(1, (used[:, None] + offsets).clamp(max=stacked.shape[1] - 1)))  # (B, 2K)
        high, low = raw[:, 0::2], raw[:, 1::2]  # (B, K) each: the first output is a number's high half
        u = (((high & 0x1FFFFF) << 32) | low).to(torch.float64) * 2.0 ** -53  # (B, K) in [0, 1): 53 bits
        drawn = offsets[0::2] < words[:, None]  # (B, K)
        noise = torch.where(drawn, -torch.log1p(-u), 1.0).to(dtype)
        self.state[rows] = stacked.reshape(len(rows), -1, MT_N)[torch.arange(len(rows)), twists]
        self.used[rows] = end - MT_N * twists
        self.next[rows] = torch.where(words > 0, self.used[rows], self.next[rows])
        return noise

    def push(self, rows: Tensor, tokens: Tensor) -> None:
        """Append tokens (B,) to the histories of rows (B,)."""
        self.recent[rows] = torch.cat([self.recent[rows, 1:], tokens[:, None]], dim=1)


def ras_sample_table(logp: Tensor, params: Sequence[SamplingParams], table: GeneratorTable,
                     slots: Sequence[int]) -> list[int | Exception]:
    """`ras_sample` for rows whose generators and histories live in `table` (row b at slots[b]): the same
    tokens and errors, with no step that loops over the rows, on the table's device. Each drawn token is
    appended to its row's history.

    The nucleus's running sum goes column by column in float32 (the official loop's order; torch's
    cumsum adds otherwise), so that loop is over top_k, not over rows.
    """
    if not params:
        return []
    device = table.device
    rows = torch.as_tensor(slots, dtype=torch.int64, device=device)  # (B,)
    logp = logp.to(device)
    probs, token_ids = logp.softmax(dim=-1).sort(dim=-1, descending=True, stable=True)  # (B, V), (B, V)
    width = min(max(p.top_k for p in params), logp.shape[-1])
    head = probs[:, :width]  # (B, K)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)[:, None]  # (B, 1)
    top_k = torch.tensor([p.top_k for p in params], device=device)[:, None]  # (B, 1)
    in_head = (_mass_before(head) < top_p) & (torch.arange(width, device=device) < top_k)  # (B, K)
    valid = _drawable(torch.where(in_head, head, 0))  # (B,)
    sizes = in_head.sum(dim=1) * valid  # (B,) an invalid row draws nothing, as multinomial refuses it first
    noise = table.exponential(rows, sizes, width, head.dtype)  # (B, K)
    in_draw = torch.arange(width, device=device) < sizes[:, None]  # (B, K)
    picks = torch.where(in_draw, head / noise, -1).argmax(dim=1)  # (B,)
    tokens = token_ids[:, :width].gather(1, picks[:, None])[:, 0]  # (B,)

    repeated = _repeats(table.recent[rows], tokens, params) & valid  # (B,)
    ok = valid.clone()
    if repeated.any():  # ban the repeated token, draw again from the whole distribution
        banned = logp[repeated].clone()  # (R, V)
        banned[torch.arange(len(banned), device=device), tokens[repeated]] = -math.inf
        full = banned.softmax(dim=-1)  # (R, V)
        redraw_ok = _drawable(full)  # (R,)
        noise = table.exponential(rows[repeated], redraw_ok * full.shape[-1], full.shape[-1], full.dtype)
        tokens[repeated] = (full / noise).argmax(dim=1)  # multinomial's one-sample draw
        ok[repeated] = redraw_ok
    table.push(rows[ok], tokens[ok])
    return [token if good else _no_distribution() for token, good in zip(tokens.tolist(), ok.tolist())]


def _mass_before(head: Tensor) -> Tensor:
    """(B, K): the float32 sum of each row's entries before column k, added left to right."""
    before = torch.zeros_like(head)
    for k in range(1, head.shape[1]):
        before[:, k] = before[:, k - 1] + head[:, k - 1]
    return before


def _drawable(probs: Tensor) -> Tensor:
    """(B,): rows torch.multinomial accepts (finite, non-negative, a positive sum)."""
    return torch.isfinite(probs).all(dim=1) & (probs >= 0).all(dim=1) & (probs.sum(dim=1) > 0)


def _repeats(recent: Tensor, tokens: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """(B,): whether tokens[b] occurs at least win_size * tau_r times among the last win_size entries of
    recent (B, W) (newest last, -1 where nothing was drawn yet)."""
    device = tokens.device
    win_size = torch.tensor([p.win_size for p in params], device=device)[:, None]  # (B, 1)
    in_window = torch.arange(recent.shape[1], 0, -1, device=device) <= win_size  # (B, W)
    counts = ((recent == tokens[:, None]) & in_window).sum(dim=1)  # (B,)
    limits = torch.tensor([p.win_size * p.tau_r for p in params], dtype=torch.float64, device=device)
    return counts >= limits


def _no_distribution() -> ValueError:
    return ValueError("the log-probs hold no distribution to draw from (NaN or no finite entry)")
