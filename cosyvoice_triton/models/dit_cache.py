"""Streaming calls of CosyVoice3's flow that compute only the frames not yet final, with a cache per stream.

Why frames become final. In a streaming call the DiT estimator (models/dit.py) attends chunk-causally (a
frame sees its own `static_chunk_size`-frame chunk, counted from the first prompt frame, and every chunk
before it); its only convolutions, the position embedding's two grouped convolutions (kernel 31, padded on
the left), are causal; everything else works frame by frame (input projection, adaptive LayerNorms,
feed-forward, output) or is the same for every frame (the time embedding); and the initial noise of frame f
is the fixed `rand_noise[:, :, f]` at every call. A frame's condition `mu` depends on its token and the 3
after it (the pre-lookahead layer; there is no chunked encoder as in CosyVoice2), and a non-final call holds
its last 3 tokens back as that right context, so every frame it makes has its final `mu`. Hence the frames
of a complete chunk keep the same hidden states in every later call of the stream, at every layer, Euler
step and guidance half: the frames after them read the same keys, values and convolution inputs from them.
The frames of the last, incomplete chunk attend to frames of their chunk still to come; the next call
computes them again.

What is cached (`StreamFlowCache`; per Euler step, both guidance halves, over the stream's first `frames`
frames, whole chunks, prompt included), in `dit.Past` order: the last 30 input frames of each position
convolution, and every layer's keys (rotated) and values. A call runs the estimator over its new frames
only, at their absolute positions (the rotary angles), attending to the cached keys first. Full-size config
(dim 1024 = 16 heads x 64, 22 layers, 10 steps, 2 halves): 22 * 2 * 1024 * 2 * 10 floats = 3.6 MB per frame
in fp32 (1.8 MB with the bf16 estimator), 180 MB per second of audio; `max_frames` bounds it.

Not cached: the pre-lookahead layer and the conditions (cheap; `conditions` recomputes them over all
tokens), and the final call of the official schedule: it attends fully (every frame sees every other),
so it computes every frame, as without a cache.

The same operations over fewer frames: a cached call's mel differs from the full re-run only by the float
summation order of products over fewer rows. Cached tensors are never written in place (a cache grows into
new tensors), so caches may share them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .dit import POS_CONV_KERNEL, DiT, Past
from .flow import FlowConditions, TokenToMel
from .flow_cache import MapRows, StreamFlowCache
from .flow_encoder import chunked_attention_mask

CONVS = 2  # Past starts with the two position convolutions' contexts; keys and values follow


def supports_cache(flow: TokenToMel) -> bool:
    """The cache needs the torch DiT's layers."""
    return isinstance(flow.decoder.estimator, DiT)


@dataclass
class _Row:
    """One guidance half of one stream over its new frames [start, start + frames)."""

    stream: int
    half: int  # 0: conditioned, 1: unconditioned (mu, spks and cond zeroed)
    start: int
    frames: int
    streaming: Tensor  # (1,) bool
    mu: Tensor  # (1, 80, frames)
    cond: Tensor  # (1, 80, frames)
    spks: Tensor  # (1, 80)


def _empty_past(est: DiT, device: torch.device, dtype: torch.dtype) -> Past:
    """The state before the first frame, both halves: zero convolution contexts, no keys or values."""
    c = est.config
    context = torch.zeros(2, c.dim, POS_CONV_KERNEL - 1, device=device, dtype=dtype)
    nothing = torch.zeros(2, c.heads, 0, c.dim_head, device=device, dtype=dtype)
    return [context] * CONVS + [nothing] * (2 * c.depth)


def _pad_time(x: Tensor, length: int) -> Tensor:
    """(B, C, T) right-padded with zeros to (B, C, length)."""
    return x if x.size(2) == length else F.pad(x, (0, length - x.size(2)))


def _estimate(est: DiT, t: Tensor, rows: list[_Row], xs: list[Tensor], pasts: list[Past]
              ) -> list[tuple[Tensor, Past]]:
    """One estimator pass over `rows`, right-padded to the longest, each after its own past (`Past` of one
    row, (1, ...) tensors). Returns per row its velocity (1, 80, frames) and its new frames' state
    (`DiT.run`'s record, N = the pass's padded length)."""
    device, R = t.device, len(rows)
    N = max(row.frames for row in rows)
    M = max(past[CONVS].size(2) for past in pasts)  # cached frames = each row's start
    j = torch.arange(N, device=device)
    positions = torch.stack([row.start + j for row in rows])  # (R, N) absolute frame indices
    new_valid = torch.stack([j < row.frames for row in rows])  # (R, N)
    past_valid = torch.stack([torch.arange(M, device=device) < past[CONVS].size(2) for past in pasts])  # (R, M)
    streaming = torch.cat([row.streaming for row in rows])
    allowed = torch.cat([past_valid[:, None, :].expand(-1, N, -1),  # cached frames: earlier, whole chunks
                         chunked_attention_mask(new_valid, est.config.static_chunk_size, streaming)], dim=2)
    past = [torch.cat([p[i] if i < CONVS else F.pad(p[i], (0, 0, 0, M - p[i].size(2))) for p in pasts])
            for i in range(len(pasts[0]))]  # contexts (R, D, 30); keys and values (R, H, M, dh), padded along M
    x, mu, cond = (torch.cat([_pad_time(y, N) for y in ys]) for ys in
                   (xs, [row.mu for row in rows], [row.cond for row in rows]))  # (R, 80, N)
    spks = torch.cat([row.spks for row in rows])
    velocity, new = est.run(x, mu, t.expand(R), spks, cond, allowed[:, None], positions, past, record=True)
    velocity = velocity.float()
    return [(velocity[r:r + 1, :, :row.frames], [s[r:r + 1] for s in new]) for r, row in enumerate(rows)]


def _extend(old: Past, halves: tuple[Past, Past], keep: int) -> Past:
    """A stream's state over its cached frames plus its first `keep` new frames, both halves (2, ...)."""
    slots = []
    for i, past in enumerate(old):
        if i < CONVS:  # the 30 convolution inputs before new frame `keep`: columns keep .. keep + 29
            slots.append(torch.cat([half[i][:, :, keep:keep + POS_CONV_KERNEL - 1] for half in halves]))
        else:  # keys or values (2, H, M, dh) ++ (2, H, keep, dh)
            slots.append(torch.cat([past, torch.cat([half[i][:, :, :keep] for half in halves])], dim=2))
    return slots


@torch.inference_mode()
def cached_mel(flow: TokenToMel, c: FlowConditions, caches: list[StreamFlowCache | None], cache_until: list[int],
               max_frames: int, voice_frames: list[int] | None = None, map_rows: MapRows | None = None
               ) -> tuple[Tensor, list[int], list[StreamFlowCache | None], list[StreamFlowCache | None]]:
    """The solver over each row's frames from the end of its cache on (models/flow_cache.py's `cached_mel`,
    same arguments and results, for the DiT).

    c: `flow.conditions(...)` of B rows. caches[b]: row b's cache (None: the row keeps none). Streaming rows
    start after their cached frames; other rows (full attention) compute every frame. A streaming, non-final
    row caches its complete chunks, up to cache_until[b] (frames; the caller's next emitted frame) and
    max_frames. voice_frames[b] > 0 (whole chunks): a streaming row that computes those frames also returns
    its cache over just them (a voice's share, models/prompt_cache.py). map_rows: run each (stream, guidance
    half) as a pass of its own over just its frames, spread by `map_rows` (a row's sums then depend on
    nothing but the row); None: one pass over all rows, right-padded, per Euler step.
    Returns (mel (B, 80, N): row b holds its frames starts[b] .. mel_len[b] - 1 from column 0, then zeros;
    starts; the caches to keep, the old object where nothing was added; the voice caches, None where none).
    """
    est: DiT = flow.decoder.estimator
    solver, chunk = flow.decoder, est.config.static_chunk_size
    B, device = c.mu.size(0), c.mu.device
    # The state's dtype: what the estimator computes in (bf16 under its bf16 autocast).
    dtype = torch.bfloat16 if solver.precision == "bf16" else c.mu.dtype
    streaming, finalize, mel_len = c.streaming.tolist(), c.finalize.tolist(), c.mel_len.tolist()

    usable = [cache if cache is not None and streaming[b] and cache.steps else None for b, cache in enumerate(caches)]
    starts = [cache.frames if cache is not None else 0 for cache in usable]
    if any(start > length for start, length in zip(starts, mel_len)):
        raise ValueError(f"cached frames {starts} beyond the call's frames {mel_len}: a stream's tokens only grow")
    keeps, voice_keeps = [], []
    for b, cache in enumerate(caches):
        whole = min(mel_len[b], max_frames) // chunk * chunk  # complete chunks (every frame's mu is final)
        end = min(whole, cache_until[b]) // chunk * chunk
        cacheable = cache is not None and streaming[b] and not finalize[b]
        keeps.append(end - starts[b] if cacheable and end > starts[b] else 0)
        voice_end = min(voice_frames[b] if voice_frames else 0, whole) // chunk * chunk
        voice_keeps.append(voice_end - starts[b] if streaming[b] and voice_end > starts[b] else 0)

    rows, xs = [], []
    for b in range(B):
        start, frames = starts[b], mel_len[b] - starts[b]
        xs.append(solver.rand_noise[:, :, start:start + frames].to(c.mu.dtype))  # (1, 80, frames): fixed noise
        mu, cond, spks = c.mu[b:b + 1, :, start:start + frames], c.cond[b:b + 1, :, start:start + frames], c.spks[b:b + 1]
        if frames > 0:
            rows += [_Row(b, 0, start, frames, c.streaming[b:b + 1], mu, cond, spks),
                     _Row(b, 1, start, frames, c.streaming[b:b + 1], torch.zeros_like(mu), torch.zeros_like(cond),
                          torch.zeros_like(spks))]
    rows.sort(key=lambda row: row.half)  # conditioned halves first, as FlowMatching batches them

    empty = _empty_past(est, device, dtype)
    new_steps: list[list[Past]] = [[] for _ in range(B)]
    voice_steps: list[list[Past]] = [[] for _ in range(B)]
    for step in range(solver.t_steps.size(0)):
        olds = [usable[b].steps[step] if usable[b] is not None else empty for b in range(B)]
        t = solver.t_steps[step].expand(1)

        def estimate(batch: list[_Row]) -> list[tuple[Tensor, Past]]:
            # Inference mode and autocast are per thread: map_rows may run this in another.
            with torch.inference_mode(), solver.estimator_arithmetic(device):
                return _estimate(est, t, batch, [xs[row.stream] for row in batch],
                                 [[slot[row.half:row.half + 1] for slot in olds[row.stream]] for row in batch])

        done = estimate(rows) if map_rows is None else [out for (out,) in map_rows(lambda row: estimate([row]), rows)]
        by_row = {(row.stream, row.half): out for row, out in zip(rows, done)}
        for b in range(B):
            if (b, 0) not in by_row:
                continue
            (v_cond, new_cond), (v_uncond, new_uncond) = by_row[(b, 0)], by_row[(b, 1)]
            xs[b] = solver.euler_step(xs[b], step, v_cond, v_uncond)
            if keeps[b]:
                new_steps[b].append(_extend(olds[b], (new_cond, new_uncond), keeps[b]))
            if voice_keeps[b]:
                voice_steps[b].append(_extend(olds[b], (new_cond, new_uncond), voice_keeps[b]))

    N = max(x.size(2) for x in xs)
    mel = torch.cat([_pad_time(x, N) for x in xs])  # (B, 80, N), zeros after each row's frames
    kept = [StreamFlowCache(starts[b] + keep, new_steps[b]) if keep else caches[b] for b, keep in enumerate(keeps)]
    voice = [StreamFlowCache(starts[b] + keep, voice_steps[b]) if keep else None for b, keep in enumerate(voice_keeps)]
    return mel, starts, kept, voice
