"""Token encoder of the CosyVoice2 flow model: 25 Hz token embeddings -> 50 Hz conditioning frames.

Layout (parameter names follow the released `flow.pt`, prefix `encoder.`):
  embed (linear + LayerNorm, scaled by sqrt(C)) -> pre_lookahead_layer (looks `pre_lookahead_len` tokens
  ahead) -> `num_blocks` conformer layers at the token rate -> up_layer (nearest x stride + causal conv)
  -> up_embed -> 4 conformer layers at the mel rate -> after_norm.

The conformer layers use Transformer-XL style relative-position self-attention (ESPnet table: sinusoids
of the offset query - key) and, in streaming mode, a chunk mask: a query sees every key in its own chunk
and all earlier chunks. Chunks are counted from position 0 of the sequence.

Batching: rows are right-padded. A row has `lengths[b]` positions that produce output, followed by
`context_lengths[b]` real look-ahead tokens (0 on a final call); everything after that is padding and is
zeroed before the look-ahead convolution, as the official code zero-pads a single row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Layers whose size the official code fixes instead of reading it from the yaml.
NUM_UP_BLOCKS = 4


@dataclass(frozen=True)
class FlowEncoderConfig:
    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = NUM_UP_BLOCKS
    static_chunk_size: int = 25  # tokens per attention chunk when streaming
    pre_lookahead_len: int = 3
    upsample_stride: int = 2  # mel frames per token

    @classmethod
    def from_yaml(cls, flow: dict) -> FlowEncoderConfig:
        """Build from the `flow` section of cosyvoice2.yaml (as returned by `config.read_yaml`)."""
        enc = flow["encoder"]
        expected = {"input_layer": "linear", "pos_enc_layer_type": "rel_pos_espnet",
                    "selfattention_layer_type": "rel_selfattn", "normalize_before": True,
                    "use_cnn_module": False, "macaron_style": False}
        for key, value in expected.items():
            if enc.get(key, value) != value:
                raise ValueError(f"flow.encoder.{key}={enc[key]!r} is not supported (expected {value!r})")
        return cls(input_size=enc["input_size"], output_size=enc["output_size"],
                   attention_heads=enc["attention_heads"], linear_units=enc["linear_units"],
                   num_blocks=enc["num_blocks"], static_chunk_size=enc["static_chunk_size"],
                   pre_lookahead_len=flow["pre_lookahead_len"], upsample_stride=flow["token_mel_ratio"])


def chunked_attention_mask(key_valid: torch.Tensor, chunk_size: int, streaming: torch.Tensor) -> torch.Tensor:
    """Which keys each query may attend to.

    key_valid: (B, T) bool, False on padding. streaming: (B,) bool; rows with True see only their own
    chunk of `chunk_size` positions and the chunks before it. Returns (B, T_query, T_key) bool.
    """
    pos = torch.arange(key_valid.size(1), device=key_valid.device)
    chunk_end = (pos // chunk_size + 1) * chunk_size  # (T,) first position after each query's chunk
    in_past_chunks = pos[None, :] < chunk_end[:, None]  # (T_query, T_key)
    allowed = in_past_chunks[None] | ~streaming[:, None, None]  # (B, T, T)
    return allowed & key_valid[:, None, :]


class InputProjection(nn.Module):
    """Linear + LayerNorm, then scaled by sqrt(C) as ESPnet's positional-encoding wrapper does."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim, eps=1e-5))
        self.xscale = math.sqrt(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class RelPositionSelfAttention(nn.Module):
    """Multi-head self-attention with relative-position scores (content bias u, position bias v)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        # Checkpoints overwrite these; the init matters only for random models (random_folder/), where
        # uninitialised memory could hold huge values.
        self.pos_bias_u = nn.Parameter(nn.init.xavier_uniform_(torch.empty(n_heads, self.head_dim)))
        self.pos_bias_v = nn.Parameter(nn.init.xavier_uniform_(torch.empty(n_heads, self.head_dim)))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C); mask: (B, T, T) bool, True = may attend; pos_emb: (1, 2T-1, C) for offsets T-1..1-T."""
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        q = self.linear_q(x).view(B, T, H, D)
        k = self.linear_k(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = self.linear_v(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        p = self.linear_pos(pos_emb).view(1, -1, H, D).transpose(1, 2)  # (1, H, 2T-1, D)

        q_content = (q + self.pos_bias_u).transpose(1, 2)  # (B, H, T, D)
        q_position = (q + self.pos_bias_v).transpose(1, 2)  # (B, H, T, D)
        content_scores = q_content @ k.transpose(-2, -1)  # (B, H, T, T); transpose keys to (D, T)
        offset_scores = q_position @ p.transpose(-2, -1)  # (B, H, T, 2T-1); one column per offset
        position_scores = self._offsets_to_keys(offset_scores)  # (B, H, T, T)
        scores = (content_scores + position_scores) / math.sqrt(D)

        blocked = ~mask[:, None]  # (B, 1, T, T)
        scores = scores.masked_fill(blocked, -float("inf"))
        weights = torch.softmax(scores, dim=-1).masked_fill(blocked, 0.0)
        out = (weights @ v).transpose(1, 2).reshape(B, T, H * D)  # (B, H, T, D) -> (B, T, C)
        return self.linear_out(out)

    @staticmethod
    def _offsets_to_keys(scores: torch.Tensor) -> torch.Tensor:
        """(B, H, T, 2T-1) indexed by offset slot -> (B, H, T, T) indexed by key.

        Slot s holds offset T-1-s, so query i and key j (offset i-j) read slot T-1-i+j.
        """
        T = scores.size(2)
        pos = torch.arange(T, device=scores.device)
        slot = (T - 1) - pos[:, None] + pos[None, :]  # (T, T)
        return scores.gather(-1, slot.expand(*scores.shape[:2], T, T))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm self-attention + feed-forward (the conformer layer without macaron FF or convolution)."""

    def __init__(self, config: FlowEncoderConfig):
        super().__init__()
        self.self_attn = RelPositionSelfAttention(config.output_size, config.attention_heads)
        self.feed_forward = FeedForward(config.output_size, config.linear_units)
        self.norm_mha = nn.LayerNorm(config.output_size, eps=1e-12)
        self.norm_ff = nn.LayerNorm(config.output_size, eps=1e-12)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos_emb)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookaheadLayer(nn.Module):
    """Residual conv pair: conv1 sees the current and the next `lookahead` tokens, conv2 is causal (k=3)."""

    def __init__(self, channels: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T + lookahead, C), look-ahead and padding already in place -> (B, T, C)."""
        h = x.transpose(1, 2)  # (B, C, T + lookahead) for Conv1d
        h = F.leaky_relu(self.conv1(h))  # (B, C, T)
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))  # causal
        return h.transpose(1, 2) + x[:, : h.size(2)]  # (B, C, T) -> (B, T, C)


class UpsampleConv(nn.Module):
    """Nearest-neighbour up-sampling by `stride`, then a causal conv of kernel 2*stride+1."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, C, T) -> (B, C, stride*T)."""
        x = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(x, (2 * self.stride, 0)))


class FlowEncoder(nn.Module):
    """The up-sampling conformer encoder (official `UpsampleConformerEncoder`, inference only)."""

    def __init__(self, config: FlowEncoderConfig):
        super().__init__()
        self.config = config
        C = config.output_size
        self.embed = InputProjection(config.input_size, C)
        self.pre_lookahead_layer = PreLookaheadLayer(C, config.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(config) for _ in range(config.num_blocks))
        self.up_layer = UpsampleConv(C, config.upsample_stride)
        self.up_embed = InputProjection(config.input_size, C)
        self.up_encoders = nn.ModuleList(ConformerLayer(config) for _ in range(config.num_up_blocks))
        self.after_norm = nn.LayerNorm(C, eps=1e-5)
        inv_freq = torch.exp(torch.arange(0, C, 2, dtype=torch.float32) * -(math.log(10000.0) / C))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (C/2,)

    def relative_positions(self, size: int) -> torch.Tensor:
        """(1, 2*size-1, C): sinusoid of offsets size-1, ..., 0, ..., 1-size (sin on even, cos on odd)."""
        offsets = torch.arange(size - 1, -size, -1, device=self.inv_freq.device, dtype=torch.float32)
        angles = offsets[:, None] * self.inv_freq[None, :]  # (2T-1, C/2)
        return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)[None]  # interleave

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, context_lengths: torch.Tensor,
                streaming: torch.Tensor) -> torch.Tensor:
        """Encode token embeddings.

        x: (B, T + pre_lookahead_len, input_size) token embeddings, right-padded.
        lengths: (B,) positions of each row that produce output (<= T).
        context_lengths: (B,) real look-ahead tokens right after them (0 .. pre_lookahead_len).
        streaming: (B,) bool, chunk masks on/off per row.
        Returns (B, stride*T, output_size); row b is valid up to stride*lengths[b].
        """
        T = x.size(1) - self.config.pre_lookahead_len
        pos = torch.arange(x.size(1), device=x.device)
        inputs_valid = pos[None, :] < (lengths + context_lengths)[:, None]  # (B, T + lookahead)
        x = self.embed(x) * inputs_valid[..., None].to(x.dtype)  # padding is zero for the look-ahead conv

        x = self.pre_lookahead_layer(x)  # (B, T, C)
        mask = chunked_attention_mask(pos[None, :T] < lengths[:, None], self.config.static_chunk_size, streaming)
        pos_emb = self.relative_positions(T).to(x.dtype)
        for layer in self.encoders:
            x = layer(x, mask, pos_emb)

        stride = self.config.upsample_stride
        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)  # (B, T, C) -> (B, C, T) -> (B, sT, C)
        x = self.up_embed(x)
        up_pos = torch.arange(stride * T, device=x.device)
        mask = chunked_attention_mask(up_pos[None, :] < stride * lengths[:, None],
                                      stride * self.config.static_chunk_size, streaming)
        pos_emb = self.relative_positions(stride * T).to(x.dtype)
        for layer in self.up_encoders:
            x = layer(x, mask, pos_emb)
        return self.after_norm(x)
