"""Vector-field estimator of the CosyVoice3 flow: a diffusion transformer (DiT) over mel frames.

Parameter names follow the released `flow.pt` under `decoder.estimator.` (the official `DiT`, built on
F5-TTS-style blocks and x-transformers' rotary embedding).

  [x | cond | mu | spks] (4 * 80 channels, in this order) -> Linear -> + causal conv position embedding
  -> `depth` x DiT block (adaptive LayerNorm from the time embedding, attention, GELU-tanh feed-forward)
  -> final adaptive LayerNorm -> Linear to 80 mel bins.

Two facts of the released weights, kept as they are:
- Rotary positions reach only the first head. The rotation is applied to q and k *before* they are split
  into heads, and it covers `dim_head` channels, so heads 1..H-1 attend without positions. The pairs are
  interleaved (GPT-J style: channels 2i and 2i+1 rotate together by frequency i).
- The attention output is masked with the attention mask's last row (every key of the row's valid frames).
Streaming uses the chunk mask of `static_chunk_size` frames counted from the first frame (prompt included):
a frame sees its own chunk and every chunk before it. The convolutions are causal, so right padding never
reaches a valid frame.

`DiT.run` is the estimator over frames at any absolute positions after earlier frames whose state is given
(`past`: the position convolutions' left context and every layer's keys and values); `forward` runs it from
the first frame. A stream's cache of that state per Euler step is models/dit_cache.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_triton.models.flow_encoder import chunked_attention_mask

TIME_FREQ_DIM = 256  # sinusoidal time features, fixed by the official code
POS_CONV_KERNEL, POS_CONV_GROUPS = 31, 16  # the causal conv position embedding, fixed likewise
NORM_EPS = 1e-6
ROPE_BASE = 10000.0

# The estimator's state over earlier frames, in this order (`DiT.run`): the left context of the two position
# convolutions (B, dim, POS_CONV_KERNEL - 1) each, then keys and values (B, heads, M, dim_head) of every layer.
Past = list[Tensor]
KeyValues = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class DiTConfig:
    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    static_chunk_size: int = 50  # mel frames per attention chunk when streaming

    @property
    def in_channels(self) -> int:
        return 2 * self.mel_dim + self.mu_dim + self.spk_dim  # x, cond, mu, spks

    @classmethod
    def from_yaml(cls, estimator: dict) -> DiTConfig:
        """Build from `flow.decoder.estimator` of cosyvoice3.yaml (as returned by `config.read_yaml`)."""
        if estimator.get("long_skip_connection", False):
            raise ValueError("flow.decoder.estimator.long_skip_connection is not supported")
        mel_dim = estimator.get("mel_dim", 80)
        config = cls(dim=estimator["dim"], depth=estimator["depth"], heads=estimator["heads"],
                     dim_head=estimator["dim_head"], ff_mult=estimator["ff_mult"], mel_dim=mel_dim,
                     mu_dim=estimator.get("mu_dim") or mel_dim, spk_dim=estimator["spk_dim"],
                     static_chunk_size=estimator["static_chunk_size"])
        if config.dim % POS_CONV_GROUPS:
            raise ValueError(f"flow.decoder.estimator.dim {config.dim} is not a multiple of {POS_CONV_GROUPS}")
        return config


def sinusoidal_time(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of 1000 * t: t (B,) -> (B, dim), sines first."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))  # (half,)
    angles = 1000 * t[:, None] * freqs[None, :]  # (B, half)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TimeEmbedding(nn.Module):
    """t (B,) -> (B, dim): sinusoidal features, Linear -> SiLU -> Linear."""

    def __init__(self, dim: int):
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.time_mlp(sinusoidal_time(t, TIME_FREQ_DIM).to(t.dtype))


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convolutions (kernel 31, 30 zeros on the left), each followed by Mish. (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, POS_CONV_KERNEL, groups=POS_CONV_GROUPS), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, POS_CONV_KERNEL, groups=POS_CONV_GROUPS), nn.Mish())

    def forward(self, x: Tensor, left: list[Tensor] | None = None) -> tuple[Tensor, list[Tensor]]:
        """x (B, T, D) -> (B, T, D). left: each convolution's last 30 input frames before x's first (B, D, 30);
        None: zeros (the first frame). Also returns each convolution's input with its left context
        (B, D, 30 + T): the context of any later frame is a slice of it."""
        inputs = []
        h = x.transpose(1, 2)  # (B, T, D) -> (B, D, T) for the convolutions
        for i, conv in enumerate((self.conv1, self.conv2)):
            inputs.append(F.pad(h, (POS_CONV_KERNEL - 1, 0)) if left is None else torch.cat([left[i], h], dim=2))
            h = conv(inputs[-1])
        return h.transpose(1, 2), inputs  # (B, D, T) -> (B, T, D)


class InputEmbedding(nn.Module):
    """[x, cond, mu, spks] (B, T, 320) -> (B, T, dim), plus the causal conv position embedding."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.proj = nn.Linear(config.in_channels, config.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(config.dim)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor,
                left: list[Tensor] | None = None) -> tuple[Tensor, list[Tensor]]:
        """x, cond, mu: (B, T, 80); spks: (B, 80); left: the position convolutions' left context
        (`CausalConvPositionEmbedding`). Returns (B, T, dim) and the convolutions' inputs."""
        spks = spks[:, None, :].expand(-1, x.shape[1], -1)  # (B, T, 80)
        h = self.proj(torch.cat([x, cond, mu, spks], dim=-1))
        position, inputs = self.conv_pos_embed(h, left)
        return position + h, inputs


class RotaryEmbedding(nn.Module):
    """Interleaved rotary angles for `dim` channels; `inv_freq` is a saved buffer of the checkpoint."""

    def __init__(self, dim: int):
        super().__init__()
        inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)  # (dim/2,): persistent, as in flow.pt

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin (..., T, dim) at integer positions (..., T), each frequency repeated for its channel pair."""
        angles = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq  # (..., T, dim/2)
        angles = angles.repeat_interleave(2, dim=-1)  # (..., T, dim)
        return angles.cos(), angles.sin()


def rotate_first_channels(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] channels of x (B, T, C) in interleaved pairs; leave the rest."""
    width = cos.shape[-1]
    head, rest = x[..., :width], x[..., width:]
    first, second = head.unflatten(-1, (width // 2, 2)).unbind(-1)  # (B, T, width/2) each
    turned = torch.stack((-second, first), dim=-1).flatten(-2)  # (B, T, width): each pair turned by 90 degrees
    return torch.cat([head * cos + turned * sin, rest], dim=-1)


class AdaLayerNormZero(nn.Module):
    """LayerNorm (no affine) modulated by the time embedding; also hands on the gates and the MLP's modulation."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, x: Tensor, t_emb: Tensor) -> tuple[Tensor, ...]:
        """x (B, T, D), t_emb (B, D) -> (normed x, gate_msa, shift_mlp, scale_mlp, gate_mlp), the last four (B, D)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(F.silu(t_emb)).chunk(6, dim=1)
        normed = F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return normed, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormFinal(nn.Module):
    """The last modulation: (scale, shift) from the time embedding, scale first."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, t_emb: Tensor) -> Tensor:
        scale, shift = self.linear(F.silu(t_emb)).chunk(2, dim=1)  # (B, D) each
        return F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) * (1 + scale)[:, None, :] + shift[:, None, :]


class Attention(nn.Module):
    """Self-attention whose rotary positions reach the first head only (module docstring)."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # `to_out.1` was dropout

    def forward(self, x: Tensor, allowed: Tensor, cos: Tensor, sin: Tensor,
                past: KeyValues | None = None) -> tuple[Tensor, KeyValues]:
        """x (B, T, D) new frames; past: keys and values (B, H, M, dh) of M earlier frames, None: none;
        allowed (B, 1, T, M + T) bool, which keys each query sees (earlier frames' first); cos, sin
        ((B,) T, dim_head) at the new frames' positions. Returns (B, T, D) and the new frames' keys and
        values (B, H, T, dh)."""
        B, T, _ = x.shape
        q = rotate_first_channels(self.to_q(x), cos, sin)  # (B, T, H*dh), positions in head 0 only
        k = rotate_first_channels(self.to_k(x), cos, sin)
        v = self.to_v(x)
        q, k, v = (y.view(B, T, self.heads, self.dim_head).transpose(1, 2) for y in (q, k, v))  # (B, H, T, dh)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
        out = self.to_out[0](out.transpose(1, 2).reshape(B, T, self.heads * self.dim_head))  # (B, H, T, dh) -> (B, T, H*dh)
        return out.masked_fill(~allowed[:, 0, -1, -T:, None], 0.0), (k, v)  # the mask's last row: zero on padding


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        # `ff.1` was dropout; the Identity keeps the output projection at `ff.2` as in the checkpoint.
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh")),
                                nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(config.dim)
        self.attn = Attention(config.dim, config.heads, config.dim_head)
        self.ff = FeedForward(config.dim, config.ff_mult)

    def forward(self, x: Tensor, t_emb: Tensor, allowed: Tensor, cos: Tensor, sin: Tensor,
                past: KeyValues | None = None) -> tuple[Tensor, KeyValues]:
        """x (B, T, D), t_emb (B, D) -> (B, T, D) and the new frames' keys and values (`Attention`)."""
        normed, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, t_emb)
        attended, new = self.attn(normed, allowed, cos, sin, past)
        x = x + gate_msa[:, None] * attended
        normed = F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp[:, None] * self.ff(normed), new


class DiT(nn.Module):
    """The velocity dx/dt of the flow ODE, called as the CosyVoice2 estimator is (`FlowMatching`)."""

    int8_blocks = (DiTBlock,)  # whose Linear layers int8-dynamic quantizes (`FlowMatching.set_precision`)

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = config
        self.time_embed = TimeEmbedding(config.dim)
        self.input_embed = InputEmbedding(config)
        self.rotary_embed = RotaryEmbedding(config.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.norm_out = AdaLayerNormFinal(config.dim)
        self.proj_out = nn.Linear(config.dim, config.mel_dim)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: Tensor) -> Tensor:
        """x, mu, cond: (B, 80, T); mask: (B, 1, T) float, 1 on valid frames; t: (B,); spks: (B, 80);
        streaming: (B,) bool, chunk attention per row. Returns the velocity (B, 80, T)."""
        allowed = chunked_attention_mask(mask[:, 0] > 0, self.config.static_chunk_size, streaming)[:, None]  # (B, 1, T, T)
        velocity, _ = self.run(x, mu, t, spks, cond, allowed, torch.arange(x.shape[2], device=x.device))
        return velocity

    def run(self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, allowed: Tensor,
            positions: Tensor, past: Past | None = None, record: bool = False) -> tuple[Tensor, Past]:
        """The velocity at N new frames that follow M earlier ones. x, mu, cond: (B, 80, N); t: (B,);
        spks: (B, 80); allowed: (B, 1, N, M + N) bool, the keys each new frame sees (earlier frames' first);
        positions: (N,) or (B, N) the frames' absolute indices (rotary angles); past: the state over the M
        earlier frames (`Past`), None: none (zero left context). Returns the velocity (B, 80, N) and, if
        `record`, the new frames' state in `Past` order: the convolutions' inputs with their left context
        (B, dim, 30 + N) and every layer's keys and values (B, heads, N, dim_head); else []."""
        t_emb = self.time_embed(t)  # (B, D)
        # (B, 80, N) -> (B, N, 80): the transformer works time-major
        h, conv_inputs = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks,
                                          None if past is None else past[:2])  # (B, N, D)
        cos, sin = self.rotary_embed(positions)  # ((B,) N, dim_head)
        new: Past = list(conv_inputs) if record else []
        for i, block in enumerate(self.transformer_blocks):
            h, keys_values = block(h, t_emb, allowed, cos, sin, None if past is None else past[2 + 2 * i:4 + 2 * i])
            if record:
                new.extend(keys_values)
        h = self.norm_out(h, t_emb)
        return self.proj_out(h).transpose(1, 2), new  # (B, N, 80) -> (B, 80, N)
