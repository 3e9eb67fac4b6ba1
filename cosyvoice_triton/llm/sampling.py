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
