"""Vector-field estimator of the CosyVoice2 flow model: a causal 1-D UNet with transformer blocks.

Parameter names follow the released `flow.pt` under `decoder.estimator.` (the official
`CausalConditionalDecoder`, whose transformer blocks are Matcha-TTS's `BasicTransformerBlock` on
diffusers' `Attention` / `FeedForward`).

One level, as in every released CosyVoice2 config (`channels: [C]`):
  [x | mu | spks | cond] (4*80 channels) -> down: resnet, transformers, causal conv
  -> mid: `num_mid_blocks` x (resnet, transformers)
  -> up: concat skip, resnet, transformers, causal conv -> final causal block -> 1x1 conv to 80 mel bins.
Every convolution is causal and is fed `x * mask`, so right padding never reaches a valid frame.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_triton.models.flow_encoder import chunked_attention_mask

# Additive attention bias for blocked keys (the official `mask_to_bias` value).
BLOCKED_BIAS = -1.0e10


@dataclass(frozen=True)
class FlowEstimatorConfig:
    in_channels: int = 320  # x, mu, spks, cond: 80 each
    out_channels: int = 80
    channels: int = 256
    attention_head_dim: int = 64
    num_heads: int = 8
    n_blocks: int = 4  # transformer blocks per UNet stage
    num_mid_blocks: int = 12
    static_chunk_size: int = 50  # mel frames per attention chunk when streaming

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.channels

    @classmethod
    def from_yaml(cls, estimator: dict) -> FlowEstimatorConfig:
        """Build from `flow.decoder.estimator` of cosyvoice2.yaml (as returned by `config.read_yaml`)."""
        if len(estimator["channels"]) != 1:
            raise ValueError(f"flow.decoder.estimator.channels={estimator['channels']}: only one level is supported")
        if estimator["act_fn"] != "gelu":
            raise ValueError(f"flow.decoder.estimator.act_fn={estimator['act_fn']!r}: only 'gelu' is supported")
        return cls(in_channels=estimator["in_channels"], out_channels=estimator["out_channels"],
                   channels=estimator["channels"][0], attention_head_dim=estimator["attention_head_dim"],
                   num_heads=estimator["num_heads"], n_blocks=estimator["n_blocks"],
                   num_mid_blocks=estimator["num_mid_blocks"], static_chunk_size=estimator["static_chunk_size"])


class CausalConv1d(nn.Conv1d):
    """Conv1d padded on the left only: output frame t sees input frames <= t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class SwapTimeChannels(nn.Module):
    """(B, C, T) <-> (B, T, C), so LayerNorm can normalise over channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalBlock(nn.Module):
    """Causal conv (k=3) -> LayerNorm over channels -> Mish, masked on both sides."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        # Indices 0 and 2 carry the weights, matching the checkpoint keys `block.0.*` and `block.2.*`.
        self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), SwapTimeChannels(), nn.LayerNorm(dim_out),
                                   SwapTimeChannels(), nn.Mish())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: (B, C, T); mask: (B, 1, T) float."""
        return self.block(x * mask) * mask


class CausalResnetBlock(nn.Module):
    """Two causal blocks with the time embedding added in between, plus a 1x1 residual conv."""

    def __init__(self, dim: int, dim_out: int, time_embed_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_embed_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        """x: (B, C_in, T); mask: (B, 1, T); t_emb: (B, time_embed_dim) -> (B, C_out, T)."""
        h = self.block1(x, mask) + self.mlp(t_emb)[:, :, None]
        h = self.block2(h, mask)
        return h + self.res_conv(x * mask)


class SelfAttention(nn.Module):
    """Multi-head self-attention with an additive bias; q/k/v without bias, output projection with."""

    def __init__(self, dim: int, n_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        inner = n_heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # `to_out.1` was dropout

    def forward(self, x: torch.Tensor, bias: torch.Tensor, keys_in: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, C) queries' input; keys_in: (B, S, C) the keys' and values' input (default x, S = T);
        bias: (B, 1, T, S) added to the scores."""
        keys_in = x if keys_in is None else keys_in
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        q = self.to_q(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.to_k(keys_in).view(B, -1, H, D).transpose(1, 2)  # (B, H, S, D)
        v = self.to_v(keys_in).view(B, -1, H, D).transpose(1, 2)  # (B, H, S, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out[0](out.transpose(1, 2).reshape(B, T, H * D))  # (B, H, T, D) -> (B, T, H*D)


class GeluProjection(nn.Module):
    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    """Linear + GELU to 4x width, then Linear back."""

    def __init__(self, dim: int):
        super().__init__()
        # `net.1` was dropout; the Identity keeps the output projection at `net.2` as in the checkpoint.
        self.net = nn.Sequential(GeluProjection(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + GELU feed-forward (x4), each with a residual connection."""

    def __init__(self, dim: int, n_heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, n_heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C); bias: (B, 1, T, T)."""
        x = self.attn1(self.norm1(x), bias) + x
        return self.ff(self.norm3(x)) + x

    def forward_cached(self, x: torch.Tensor, past: torch.Tensor,
                       bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` over new frames after cached ones (models/flow_cache.py). x: (B, N, C) new frames;
        past: (B, M, C) the cached frames' normed inputs; bias: (B, 1, N, M + N) over cached then new keys.
        Returns (output (B, N, C), the new frames' normed input (B, N, C), to cache)."""
        normed = self.norm1(x)
        x = self.attn1(normed, bias, torch.cat([past, normed], dim=1)) + x
        return self.ff(self.norm3(x)) + x, normed


class TimestepEmbedding(nn.Module):
    """Sinusoidal embedding of 1000*t, then Linear -> SiLU -> Linear."""

    def __init__(self, in_channels: int, time_embed_dim: int):
        super().__init__()
        half = in_channels // 2
        freqs = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))
        self.register_buffer("freqs", freqs, persistent=False)  # (in_channels/2,)
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t: (B,) in [0, 1] -> (B, time_embed_dim)."""
        angles = 1000 * t[:, None] * self.freqs[None, :]  # (B, in_channels/2)
        emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
        return self.linear_2(F.silu(self.linear_1(emb)))


class FlowEstimator(nn.Module):
    """The causal conditional UNet that predicts the flow velocity dx/dt."""

    int8_blocks = (TransformerBlock,)  # whose Linear layers int8-dynamic quantizes (`FlowMatching.set_precision`)

    def __init__(self, config: FlowEstimatorConfig):
        super().__init__()
        self.config = config
        C, T_DIM = config.channels, config.time_embed_dim

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(C, config.num_heads, config.attention_head_dim)
                                 for _ in range(config.n_blocks))

        self.time_mlp = TimestepEmbedding(config.in_channels, T_DIM)
        self.down_blocks = nn.ModuleList([nn.ModuleList([
            CausalResnetBlock(config.in_channels, C, T_DIM), transformers(), CausalConv1d(C, C, 3)])])
        self.mid_blocks = nn.ModuleList(nn.ModuleList([CausalResnetBlock(C, C, T_DIM), transformers()])
                                        for _ in range(config.num_mid_blocks))
        self.up_blocks = nn.ModuleList([nn.ModuleList([
            CausalResnetBlock(2 * C, C, T_DIM), transformers(), CausalConv1d(C, C, 3)])])
        self.final_block = CausalBlock(C, C)
        self.final_proj = nn.Conv1d(C, config.out_channels, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: torch.Tensor) -> torch.Tensor:
        """Velocity at time t.

        x, mu, cond: (B, 80, T); mask: (B, 1, T) float, 1 on valid frames; t: (B,); spks: (B, 80);
        streaming: (B,) bool, chunk attention per row. Returns (B, 80, T), zero on padding.
        """
        t_emb = self.time_mlp(t)  # (B, time_embed_dim)
        h = torch.cat([x, mu, spks[:, :, None].expand_as(x), cond], dim=1)  # (B, 320, T)
        allowed = chunked_attention_mask(mask[:, 0] > 0, self.config.static_chunk_size, streaming)  # (B, T, T)
        bias = ((1.0 - allowed.to(x.dtype)) * BLOCKED_BIAS)[:, None]  # (B, 1, T, T)

        def run_transformers(h: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
            h = h.transpose(1, 2)  # (B, C, T) -> (B, T, C)
            for block in blocks:
                h = block(h, bias)
            return h.transpose(1, 2)  # (B, T, C) -> (B, C, T)

        (resnet, blocks, downsample), = self.down_blocks
        h = run_transformers(resnet(h, mask, t_emb), blocks)
        skip = h
        h = downsample(h * mask)
        for resnet, blocks in self.mid_blocks:
            h = run_transformers(resnet(h, mask, t_emb), blocks)
        (resnet, blocks, upsample), = self.up_blocks
        h = torch.cat([h, skip], dim=1)  # (B, 2C, T)
        h = run_transformers(resnet(h, mask, t_emb), blocks)
        h = upsample(h * mask)
        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask
