"""Repetition-aware sampling (RAS) of speech tokens, as CosyVoice2 does it, with a per-request generator.

One draw: take the smallest head of the probability-sorted vocabulary whose mass reaches `top_p`, at
most `top_k` tokens, and draw from it. If the drawn token already occurs at least `win_size * tau_r`
times among the last `win_size` decoded tokens, ban it and draw again from the whole distribution.

The operations and their order follow the official `ras_sampling` in `cosyvoice/utils/common.py`
(stable descending sort, float32 running sum of the head, one multinomial draw per step), so a
generator seeded with s draws the same tokens as the official code after `torch.manual_seed(s)` on the
CPU. Every request owns its `torch.Generator`: its draws never depend on other requests. Draws run on
the generator's device; a CPU generator (the default) makes them independent of the model's device.
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


def nucleus_sample(logp: Tensor, top_p: float, top_k: int, generator: torch.Generator | None) -> int:
    """Draw from the top-p head (at most top_k tokens) of logp (V,)."""
    probs, token_ids = logp.softmax(dim=0).sort(descending=True, stable=True)  # (V,), (V,)
    head = probs[:top_k]  # (K,)
    # A token joins the head while the mass before it is below top_p. The sum runs sequentially in
    # float32, as the official loop does; numpy's cumsum does that (torch's accumulates in float64).
    running = np.cumsum(head.cpu().numpy(), dtype=np.float32)
    mass_before = np.concatenate([np.zeros(1, dtype=np.float32), running[:-1]])
    head_size = int((mass_before < np.float32(top_p)).sum())
    return int(token_ids[draw(head[:head_size], generator)])


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
    """The official repetition-aware sampler bound to one SamplingParams."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()

    def __call__(self, logp: Tensor, decoded: Sequence[int], generator: torch.Generator | None) -> int:
        p = self.params
        token = nucleus_sample(logp, p.top_p, p.top_k, generator)
        repeats = list(decoded[-p.win_size:]).count(token)
        if repeats >= p.win_size * p.tau_r:
            banned = logp.clone()
            banned[token] = -math.inf
            token = full_sample(banned, generator)
        return token
