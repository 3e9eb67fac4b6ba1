"""Streaming flow calls that compute only the frames not yet final, with a cache per stream.

In streaming mode the estimator's attention is chunk-causal (a frame sees its own `static_chunk_size`-frame
chunk and the chunks before it), all its convolutions are causal, the encoder's attention is chunk-causal
per 25-token chunk and the noise is fixed. So once a call has seen every token of a 25-token chunk (plus
its 3 look-ahead tokens, which are real tokens in a non-final call), the estimator's hidden states of that
chunk's 50 frames never change again in that stream: at every Euler step and in both guidance halves, the
frames after them see exactly the same keys, values and convolution inputs. Frames of a chunk that is not
complete yet see look-ahead tokens and keys that will change: they are recomputed by the next call.

`StreamFlowCache` keeps, per Euler step, for both guidance halves, over the stream's first `frames` frames
(prompt included, a multiple of the chunk size):
- the normed input of every attention layer (keys and values are recomputed from it each call: a quarter
  of the memory of keys and values, for 2 of the 6 matrix products a cached frame would otherwise cost);
- the last kernel - 1 input frames of every causal convolution.
Full-size config (256 channels, 56 transformer blocks, 10 steps, 2 halves): 56 * 256 * 2 * 10 floats =
1.15 MB per frame in fp32, 57 MB per second of audio (50 frames), prompt frames included.

The encoder is run over all tokens at every call (one pass of a 10-layer conformer, against the
estimator's 20 passes of 56 transformer blocks); only the estimator is cached. A row that is not streaming (the final full-attention
pass) or has no cache computes every frame: with an empty cache the code is the plain estimator.

The prompt's first frames depend only on the voice; models/prompt_cache.py keeps a cache over them per
prompt, so that a new stream of that prompt starts from it (`cached_mel(..., voice_frames=...)` returns it).
Cached tensors are never written in place: a cache grows into new tensors, so streams may share them.

On the CPU the solver may take each stream's two guidance halves as rows of their own (`map_rows`,
`_solve_by_row`): a pass of one row over just its frames, so that a row's sums depend on nothing but the
row, and the rows of an Euler step can run side by side on as many cores as are free at that step
(pipeline/threads.py `RowWorkers`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .flow import FlowConditions, FlowModel
from .flow_encoder import chunked_attention_mask
from .flow_estimator import BLOCKED_BIAS, CausalBlock, CausalConv1d, CausalResnetBlock, FlowEstimator, TransformerBlock


# map_rows(fn, rows) -> [fn(row) for row in rows], in order, however it spreads them (pipeline/threads.py RowWorkers).
MapRows = Callable[[Callable[[Any], Any], Sequence[Any]], list]


@dataclass(frozen=True)
class FlowCacheSettings:
    """Per-stream flow caches (see the module docstring)."""

    enabled: bool = True
    # Frames cached per stream, prompt included (1.15 MB each on the full-size config; CosyVoice3's DiT 3.6 MB);
    # None: the family's default (`ModelFamily.flow_cache_frames`, models/family.py `cache_settings`).
    max_frames: int | None = None
    cached_final: bool = False  # final chunk: False = one full-attention pass (official); True = cached, streaming
    # The voices' share (models/prompt_cache.py): MB of voice-final prompt frames kept per flow model; 0: off.
    prompt_cache_mb: float = 512.0


@dataclass
class StreamFlowCache:
    """The estimator's state over a stream's first `frames` mel frames (prompt included).

    steps[s] lists, in the estimator's forward order, one tensor per attention layer (2, frames, C) and
    per causal convolution (2, C_in, kernel - 1); dim 0 is the guidance half (conditioned, unconditioned).
    """

    frames: int = 0
    steps: list[list[Tensor]] = field(default_factory=list)
    # Set on a new stream's empty cache (models/prompt_cache.py): its first streaming call also returns the
    # voice's frames, which the caller stores under this key.
    voice_key: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for step in self.steps for t in step)

    def replace_with(self, other: StreamFlowCache) -> None:
        self.frames, self.steps, self.voice_key = other.frames, other.steps, other.voice_key


def supports_cache(flow: FlowModel) -> bool:
    """The cache needs the torch estimator's layers; ONNX / TensorRT / OpenVINO graphs re-run every frame."""
    return isinstance(flow.decoder.estimator, FlowEstimator)


class _Pass:
    """One estimator pass over the new frames of a batch: cached slots are read in forward order, and the
    new frames' slots are recorded in the same order."""

    def __init__(self, past: list[Tensor]):
        self.past = iter(past)
        self.new: list[Tensor] = []

    def conv(self, conv: CausalConv1d, x: Tensor) -> Tensor:
        """x: (2B, C_in, N) masked input -> (2B, C_out, N), with the cached left context."""
        self.new.append(x)
        return F.conv1d(torch.cat([next(self.past), x], dim=2), conv.weight, conv.bias)

    def causal_block(self, block: CausalBlock, x: Tensor, mask: Tensor) -> Tensor:
        conv, *rest = block.block
        h = self.conv(conv, x * mask)
        for layer in rest:
            h = layer(h)
        return h * mask

    def resnet(self, block: CausalResnetBlock, x: Tensor, mask: Tensor, t_emb: Tensor) -> Tensor:
        h = self.causal_block(block.block1, x, mask) + block.mlp(t_emb)[:, :, None]
        h = self.causal_block(block.block2, h, mask)
        return h + block.res_conv(x * mask)

    def transformer(self, block: TransformerBlock, x: Tensor, bias: Tensor) -> Tensor:
        """x: (2B, N, C) new frames; bias: (2B, 1, N, M + N) over cached then new keys."""
        x, normed = block.forward_cached(x, next(self.past), bias)
        self.new.append(normed)
        return x

    def estimator(self, est: FlowEstimator, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor,
                  cond: Tensor, bias: Tensor) -> Tensor:
        """`FlowEstimator.forward` over the new frames: x, mu, cond (2B, 80, N); mask (2B, 1, N) -> (2B, 80, N)."""
        t_emb = est.time_mlp(t)  # (2B, time_embed_dim)
        h = torch.cat([x, mu, spks[:, :, None].expand_as(x), cond], dim=1)  # (2B, 320, N)

        def transformers(h: Tensor, blocks) -> Tensor:
            h = h.transpose(1, 2)  # (2B, C, N) -> (2B, N, C)
            for block in blocks:
                h = self.transformer(block, h, bias)
            return h.transpose(1, 2)  # (2B, N, C) -> (2B, C, N)

        (resnet, blocks, downsample), = est.down_blocks
        h = transformers(self.resnet(resnet, h, mask, t_emb), blocks)
        skip = h
        h = self.conv(downsample, h * mask)
        for resnet, blocks in est.mid_blocks:
            h = transformers(self.resnet(resnet, h, mask, t_emb), blocks)
        (resnet, blocks, upsample), = est.up_blocks
        h = torch.cat([h, skip], dim=1)  # (2B, 2C, N)
        h = transformers(self.resnet(resnet, h, mask, t_emb), blocks)
        h = self.conv(upsample, h * mask)
        h = self.causal_block(est.final_block, h, mask)
        return est.final_proj(h * mask) * mask


def _empty_step(est: FlowEstimator, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """The slots of a pass over no cached frames: attention inputs of length 0, zero conv contexts."""
    C = est.config.channels
    slots: list[Tensor] = []

    def resnet(block: CausalResnetBlock) -> None:
        for causal in (block.block1, block.block2):
            conv = causal.block[0]
            slots.append(torch.zeros(2, conv.in_channels, conv.kernel_size[0] - 1, device=device, dtype=dtype))

    def stage(resnet_block, blocks, conv=None) -> None:
        resnet(resnet_block)
        slots.extend(torch.zeros(2, 0, C, device=device, dtype=dtype) for _ in blocks)
        if conv is not None:
            slots.append(torch.zeros(2, conv.in_channels, conv.kernel_size[0] - 1, device=device, dtype=dtype))

    (r, blocks, down), = est.down_blocks
    stage(r, blocks, down)
    for r, blocks in est.mid_blocks:
        stage(r, blocks)
    (r, blocks, up), = est.up_blocks
    stage(r, blocks, up)
    conv = est.final_block.block[0]
    slots.append(torch.zeros(2, conv.in_channels, conv.kernel_size[0] - 1, device=device, dtype=dtype))
    return slots


def _batch_slots(per_row: list[list[Tensor]], attention: list[bool], width: int) -> list[Tensor]:
    """Per-row slots (2, ...) -> batch slots (2B, ...), all rows' conditioned halves first; attention inputs
    right-padded to `width` cached frames (the bias blocks the padding)."""
    if len(per_row) == 1:
        return per_row[0]
    batch = []
    for is_attention, slots in zip(attention, zip(*per_row)):
        if is_attention:
            slots = [F.pad(t, (0, 0, 0, width - t.size(1))) for t in slots]
        batch.append(torch.stack(slots, dim=1).flatten(0, 1))  # (2, B, ...) -> (2B, ...)
    return batch


def _extend(old: list[Tensor], new: list[Tensor], attention: list[bool], b: int, B: int, keep: int) -> list[Tensor]:
    """Row b's slots over its cached frames plus its first `keep` new frames."""
    slots = []
    for is_attention, past, now in zip(attention, old, new):
        now = now[b::B]  # rows b and B + b: (2, ...)
        if is_attention:  # (2, L, C) ++ (2, keep, C)
            slots.append(torch.cat([past, now[:, :keep]], dim=1))
        else:  # the kernel - 1 input frames before the new end
            context = past.size(2)
            slots.append(torch.cat([past, now[:, :, :keep]], dim=2)[:, :, keep:keep + context].clone())
    return slots


@torch.inference_mode()
def cached_mel(flow: FlowModel, c: FlowConditions, caches: list[StreamFlowCache | None], cache_until: list[int],
               max_frames: int, voice_frames: list[int] | None = None, map_rows: MapRows | None = None
               ) -> tuple[Tensor, list[int], list[StreamFlowCache | None], list[StreamFlowCache | None]]:
    """The solver over each row's frames from the end of its cache on.

    c: `flow.conditions(...)` of B rows. caches[b]: row b's cache (None: the row keeps none). Streaming rows
    start after their cached frames; other rows (full attention) compute every frame. A streaming, non-final
    row caches the frames that are final, up to cache_until[b] (frames; the caller's next emitted frame) and
    max_frames, in whole chunks. voice_frames[b] > 0 (whole chunks, from `prompt_cache.voice_final_frames`):
    a streaming row that computes those frames also returns its cache over just them (the voice's share).
    map_rows (CPU): solve each stream's two guidance halves as rows of their own, each an estimator pass
    of one row over just its frames, spread by `map_rows` over the cores (`_solve_by_row`); None: one
    estimator pass over the padded batch per Euler step.
    Returns (mel (B, 80, N): row b holds its frames starts[b] .. mel_len[b] - 1 from column 0, then zeros;
    starts; the caches to keep, the old object where nothing was added; the voice caches, None where none).
    """
    est: FlowEstimator = flow.decoder.estimator
    chunk, enc_chunk = est.config.static_chunk_size, flow.encoder.config.static_chunk_size
    ratio, B, device, dtype = flow.config.token_mel_ratio, c.mu.size(0), c.mu.device, c.mu.dtype
    streaming, finalize = c.streaming.tolist(), c.finalize.tolist()
    mel_len, enc_len = c.mel_len.tolist(), c.enc_len.tolist()

    empty = _empty_step(est, device, dtype)
    attention = [t.size(1) == 0 for t in empty]
    usable = [cache if cache is not None and streaming[b] and cache.steps else None
              for b, cache in enumerate(caches)]
    starts = [cache.frames if cache is not None else 0 for cache in usable]
    keeps, voice_keeps = [], []
    for b, cache in enumerate(caches):
        final = ratio * (enc_len[b] // enc_chunk * enc_chunk)  # frames whose encoder input is final
        end = min(final, cache_until[b], max_frames) // chunk * chunk
        cacheable = cache is not None and streaming[b] and not finalize[b]
        keeps.append(end - starts[b] if cacheable and end > starts[b] else 0)
        voice_end = min(voice_frames[b] if voice_frames else 0, final, max_frames) // chunk * chunk
        voice_keeps.append(voice_end - starts[b] if streaming[b] and voice_end > starts[b] else 0)

    if map_rows is not None:
        x, new_steps, voice_steps = _solve_by_row(flow, c, usable, starts, keeps, voice_keeps, empty, attention,
                                                  map_rows)
        return _results(x, starts, caches, keeps, voice_keeps, new_steps, voice_steps)

    N = max(length - start for length, start in zip(mel_len, starts))
    j = torch.arange(N, device=device)[None, :]  # (1, N)
    start = torch.tensor(starts, device=device)[:, None]  # (B, 1)
    frame = (start + j).clamp(max=c.mu.size(2) - 1)[:, None, :]  # (B, 1, N) absolute frame of column j
    mask = (j < c.mel_len[:, None] - start).to(dtype)[:, None, :]  # (B, 1, N)
    mu = c.mu.gather(2, frame.expand(-1, c.mu.size(1), -1))  # (B, 80, N)
    cond = c.cond.gather(2, frame.expand(-1, c.cond.size(1), -1))  # (B, 80, N)
    noise = flow.decoder.rand_noise
    x = noise.expand(B, -1, -1).gather(2, frame.expand(-1, noise.size(1), -1)).to(dtype)  # (B, 80, N)

    # Guidance: rows B..2B-1 repeat x and mask with mu, spks and cond zeroed (as FlowMatching.forward).
    mask2, streaming2 = torch.cat([mask, mask]), torch.cat([c.streaming, c.streaming])
    mu2, spks2 = torch.cat([mu, torch.zeros_like(mu)]), torch.cat([c.spks, torch.zeros_like(c.spks)])
    cond2 = torch.cat([cond, torch.zeros_like(cond)])
    M = max(starts)
    past_valid = (torch.arange(M, device=device)[None, :] < start).repeat(2, 1)  # (2B, M) cached keys
    new_allowed = chunked_attention_mask(mask2[:, 0] > 0, chunk, streaming2)  # (2B, N, N); starts are chunk-aligned
    allowed = torch.cat([past_valid[:, None, :].expand(-1, N, -1), new_allowed], dim=2)  # (2B, N, M + N)
    bias = ((1.0 - allowed.to(dtype)) * BLOCKED_BIAS)[:, None]  # (2B, 1, N, M + N)

    solver = flow.decoder
    new_steps: list[list[list[Tensor]]] = [[] for _ in range(B)]
    voice_steps: list[list[list[Tensor]]] = [[] for _ in range(B)]
    for step in range(solver.t_steps.size(0)):
        rows = [cache.steps[step] if cache is not None else empty for cache in usable]
        p = _Pass(_batch_slots(rows, attention, M))
        t = solver.t_steps[step].expand(2 * B)
        with solver.estimator_arithmetic(device):
            velocity = p.estimator(est, torch.cat([x, x]), mask2, mu2, t, spks2, cond2, bias).float()
        x = solver.euler_step(x, step, *velocity.split(B))
        for b, keep in enumerate(keeps):
            if keep:
                new_steps[b].append(_extend(rows[b], p.new, attention, b, B, keep))
        for b, keep in enumerate(voice_keeps):
            if keep:
                voice_steps[b].append(_extend(rows[b], p.new, attention, b, B, keep))

    return _results(x * mask, starts, caches, keeps, voice_keeps, new_steps, voice_steps)


def _results(mel: Tensor, starts: list[int], caches: list[StreamFlowCache | None], keeps: list[int],
             voice_keeps: list[int], new_steps: list[list[list[Tensor]]], voice_steps: list[list[list[Tensor]]]):
    """`cached_mel`'s return value from the solved mel and each row's new slots."""
    kept = [StreamFlowCache(starts[b] + keep, new_steps[b]) if keep else caches[b] for b, keep in enumerate(keeps)]
    voice = [StreamFlowCache(starts[b] + keep, voice_steps[b]) if keep else None for b, keep in enumerate(voice_keeps)]
    return mel, starts, kept, voice


def _solve_by_row(flow: FlowModel, c: FlowConditions, usable: list[StreamFlowCache | None], starts: list[int],
                  keeps: list[int], voice_keeps: list[int], empty: list[Tensor], attention: list[bool],
                  map_rows: MapRows) -> tuple[Tensor, list[list[list[Tensor]]], list[list[list[Tensor]]]]:
    """The solver with each (stream, guidance half) as a row of its own: a pass over that row's frames
    only, its cached keys unpadded. A row's sums then depend on nothing but the row (not on the other
    streams of the batch, nor on how many rows run at once), so `map_rows` may run the 2B rows of each
    Euler step on as many cores as are free at that step. Returns (mel (B, 80, N), each row's new
    slots per step, its voice slots per step), as the batched loop of `cached_mel` makes them."""
    est: FlowEstimator = flow.decoder.estimator
    solver, chunk = flow.decoder, est.config.static_chunk_size
    B, device, dtype = c.mu.size(0), c.mu.device, c.mu.dtype
    spans = list(zip(starts, c.mel_len.tolist()))  # (first frame computed, end) per stream
    xs, halves = [], []  # per stream: x (1, 80, N_b); per stream, per half: the estimator's inputs but x
    for b, (start, end) in enumerate(spans):
        N = end - start
        xs.append(solver.rand_noise[:, :, start:end].to(dtype))  # (1, 80, N)
        mask = torch.ones(1, 1, N, device=device, dtype=dtype)
        new_allowed = chunked_attention_mask(mask[:, 0] > 0, chunk, c.streaming[b:b + 1])  # (1, N, N)
        allowed = torch.cat([torch.ones(1, N, start, dtype=torch.bool, device=device), new_allowed], dim=2)
        bias = ((1.0 - allowed.to(dtype)) * BLOCKED_BIAS)[:, None]  # (1, 1, N, start + N): cached then new keys
        mu, cond, spks = c.mu[b:b + 1, :, start:end], c.cond[b:b + 1, :, start:end], c.spks[b:b + 1]
        halves.append([(mask, mu, spks, cond, bias),  # conditioned
                       (mask, torch.zeros_like(mu), torch.zeros_like(spks), torch.zeros_like(cond), bias)])
    rows = [(b, half) for half in range(2) for b in range(B) if spans[b][1] > spans[b][0]]
    new_steps: list[list[list[Tensor]]] = [[] for _ in range(B)]
    voice_steps: list[list[list[Tensor]]] = [[] for _ in range(B)]
    for step in range(solver.t_steps.size(0)):
        slots = [usable[b].steps[step] if usable[b] is not None else empty for b in range(B)]
        t = solver.t_steps[step].expand(1)

        def row_pass(row: tuple[int, int]) -> tuple[Tensor, list[Tensor]]:
            b, half = row
            mask, mu, spks, cond, bias = halves[b][half]
            p = _Pass([slot[half:half + 1] for slot in slots[b]])
            # Inference mode and autocast are per thread: map_rows may run this in another.
            with torch.inference_mode(), solver.estimator_arithmetic(device):
                velocity = p.estimator(est, xs[b], mask, mu, t, spks, cond, bias).float()  # (1, 80, N_b)
            return velocity, p.new

        done = dict(zip(rows, map_rows(row_pass, rows)))
        for b in range(B):
            if (b, 0) not in done:
                continue
            (v_cond, new_cond), (v_uncond, new_uncond) = done[(b, 0)], done[(b, 1)]
            xs[b] = solver.euler_step(xs[b], step, v_cond, v_uncond)
            new = [torch.cat(pair) for pair in zip(new_cond, new_uncond)]  # (2, ...) per slot: both halves
            if keeps[b]:
                new_steps[b].append(_extend(slots[b], new, attention, 0, 1, keeps[b]))
            if voice_keeps[b]:
                voice_steps[b].append(_extend(slots[b], new, attention, 0, 1, voice_keeps[b]))
    N = max(end - start for start, end in spans)
    mel = torch.stack([F.pad(x[0], (0, N - x.size(2))) for x in xs])  # (B, 80, N), zeros after each row's frames
    return mel, new_steps, voice_steps
