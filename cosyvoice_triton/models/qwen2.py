"""A compact Qwen2 decoder with a static, slot-addressed KV cache.

The parameter names equal those of the Hugging Face checkpoint (`embed_tokens`, `layers.N.self_attn.q_proj`,
..., `norm`), so CosyVoice2's `llm.pt` loads with `strict=True`. Two ways to run it:

- `forward(x, input_pos, slots, kv_len)`: cached. Row b of the batch writes its keys/values into cache
  slot `slots[b]` at positions `input_pos[b]` and attends to every cached position j <= its own position
  among the first `kv_len` (the used prefix, rounded up to a bucket by `kv_bucket`, so a step costs
  what its context needs, not the whole static cache). The same call does prefill (T > 1) and decode
  (T = 1), and it never reads a value back to the host, so a fixed-shape decode step (one per bucket)
  can be captured in a CUDA graph. With `rows_apart` (set on a CPU: models/llm_precision.py, "Batch-invariant
  decode") a decode step attends row by row instead, each row over exactly its own prefix (`row_attention`),
  reading the rows' slots and positions on the host.
- `forward_full(x)`: no cache, causal attention over the whole sequence (one-shot scoring).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, data: dict) -> Qwen2Config:
        """Build from a Hugging Face `config.json` dict; absent optional keys take the HF defaults."""
        if data.get("rope_scaling"):
            raise ValueError(f"rope_scaling {data['rope_scaling']} is not supported")
        if data.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        names = [f.name for f in fields(cls) if f.init]
        return cls(**{name: data[name] for name in names if name in data})


KV_BUCKET = 128  # attention spans the used cache prefix rounded up to a multiple of this


def kv_bucket(used: int, max_seq_len: int) -> int:
    """Cache positions a step attends over when positions [0, used) are in use: `used` rounded up to a
    multiple of KV_BUCKET, at most `max_seq_len`."""
    return min(max_seq_len, -(-used // KV_BUCKET) * KV_BUCKET)


def rope_tables(config: Qwen2Config, num_positions: int) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, each (num_positions, head_dim); halves repeat (non-interleaved)."""
    half = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** half)  # (head_dim/2,)
    angles = torch.arange(num_positions).float()[:, None] * inv_freq[None, :]  # (P, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (P, head_dim)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, H, T, hd) by angles whose cos/sin are (B, T, hd) or (T, hd)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hd): broadcast over heads
    x32 = x.float()  # rotated in float32 whatever the activations' dtype (a no-op in fp32)
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class KVCache(nn.Module):
    """Keys and values of `max_batch` independent streams, `max_seq_len` positions each."""

    def __init__(self, max_batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        shape = (max_batch, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, slots: Tensor, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k, v (B, Hkv, T, hd) at (slots (B,), input_pos (B, T))."""
        # Index pairs (slot, position) broadcast to (B, T); the head axis left as `:` then comes after
        # them, so the destination is laid out (B, T, Hkv, hd).
        rows = slots[:, None]
        self.k[rows, :, input_pos] = k.transpose(1, 2)  # (B, T, Hkv, hd): time before heads
        self.v[rows, :, input_pos] = v.transpose(1, 2)  # (B, T, Hkv, hd): time before heads

    def update(self, slots: Tensor, input_pos: Tensor, k: Tensor, v: Tensor,
               kv_len: int) -> tuple[Tensor, Tensor]:
        """`write`, then return the rows' first `kv_len` cache positions (B, Hkv, kv_len, hd)."""
        self.write(slots, input_pos, k, v)
        return (self.k[:, :, :kv_len].index_select(0, slots),
                self.v[:, :, :kv_len].index_select(0, slots))

    def prefix(self, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """Slot `slot`'s first `length` positions: k, v (1, Hkv, length, hd), views of the cache."""
        return self.k[slot:slot + 1, :, :length], self.v[slot:slot + 1, :, :length]


def row_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(hd)) v of one row's query over all the keys given, in float32 as plain products.

    q (1, H, 1, hd), k and v (1, Hkv, n, hd) -> (1, H, 1, hd) in q's dtype. Called with a row's own written
    prefix, every product has the shapes of that row's step alone, whatever else the batch holds: its sums
    run in the same order (the batched products' kernels block the attended length differently for another
    length, and SDPA's CPU kernel sums a head's float32 products in an order that depends on the thread
    that runs it; models/llm_precision.py, "Batch-invariant decode").
    """
    _, heads, _, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads  # query heads per key/value head (GQA: head h reads kv head h // group)
    queries = q.float().reshape(kv_heads, group, head_dim)  # (Hkv, G, hd)
    keys = k.float().reshape(kv_heads, length, head_dim)  # (Hkv, n, hd)
    scores = torch.bmm(queries, keys.transpose(1, 2)) * head_dim ** -0.5  # (Hkv, G, n): keys' time last
    y = torch.bmm(scores.softmax(dim=-1), v.float().reshape(kv_heads, length, head_dim))  # (Hkv, G, hd)
    return y.reshape(1, heads, 1, head_dim).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.kv_cache: KVCache | None = None
        # Decode steps attend row by row (`row_attention`), each row over its own prefix: batch-invariant,
        # with host reads of the rows' slots and positions (free on a CPU; a CUDA graph keeps the batched SDPA).
        self.rows_apart = False

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                slots: Tensor | None, input_pos: Tensor | None) -> Tensor:
        """x (B, T, D) -> (B, T, D). With `slots`/`input_pos` the cache is used and `mask`
        (B, 1, T, S') says which of the first S' cache positions each query sees; without them attention
        is causal."""
        batch, length, _ = x.shape
        # (B, T, H*hd) -> (B, T, H, hd) -> (B, H, T, hd): heads before time for attention
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if slots is not None:
            assert self.kv_cache is not None, "call setup_caches() before a cached forward"
        if slots is not None and length == 1 and self.rows_apart:  # a decode step, each row over its own prefix
            y = self._attend_rows(q, k, v, slots, input_pos)
        else:
            if slots is not None:
                k, v = self.kv_cache.update(slots, input_pos, k, v, mask.shape[-1])  # (B, Hkv, S', hd)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
        y = y.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)  # (B, T, H*hd): time first again
        return self.o_proj(y)

    def _attend_rows(self, q: Tensor, k: Tensor, v: Tensor, slots: Tensor, input_pos: Tensor) -> Tensor:
        """Write the step's k, v (B, Hkv, 1, hd); each row's q (B, H, 1, hd) over its slot's positions up to its
        own -> (B, H, 1, hd)."""
        self.kv_cache.write(slots, input_pos, k, v)
        rows = zip(slots.tolist(), input_pos[:, 0].tolist())
        return torch.cat([row_attention(q[b:b + 1], *self.kv_cache.prefix(slot, position + 1))
                          for b, (slot, position) in enumerate(rows)])


class MLP(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                slots: Tensor | None, input_pos: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, slots, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Decoder(nn.Module):
    """The Qwen2 backbone (HF `Qwen2Model`): input embeddings in, final-norm hidden states out.

    `max_seq_len` bounds the positions of both forwards (rotary tables and cache length)."""

    def __init__(self, config: Qwen2Config, max_seq_len: int):
        super().__init__()
        if max_seq_len > config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} > max_position_embeddings "
                             f"{config.max_position_embeddings}")
        self.config = config
        self.max_seq_len = max_seq_len
        self.max_batch = 0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        cos, sin = rope_tables(config, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)  # (S, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (S, hd)
        self.register_buffer("cache_positions", torch.arange(max_seq_len), persistent=False)  # (S,)

    def setup_caches(self, max_batch: int) -> None:
        """(Re)allocate a zeroed KV cache of `max_batch` slots on the weights' device and dtype."""
        weight = self.embed_tokens.weight
        self.max_batch = max_batch
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(max_batch, self.config.num_key_value_heads, self.max_seq_len,
                                               self.config.head_dim, weight.dtype, weight.device)

    def forward(self, x: Tensor, input_pos: Tensor, slots: Tensor, kv_len: int | None = None) -> Tensor:
        """Cached forward. x (B, T, D), input_pos (B, T) int64, slots (B,) int64 -> hidden (B, T, D).

        Attention spans cache positions [0, kv_len) (default: the whole cache); every input position
        must lie below kv_len (the caller knows them: `kv_bucket(max position + 1, max_seq_len)`).
        A key at cache position j is visible to a query at position p iff j <= p; positions a row has
        not written in this request must therefore lie above its current position (write from 0 up)."""
        kv_len = self.max_seq_len if kv_len is None else kv_len
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # (B, T, hd)
        positions = self.cache_positions[:kv_len]  # (S',)
        mask = positions[None, None, None, :] <= input_pos[:, None, :, None]  # (B, 1, T, S')
        for layer in self.layers:
            x = layer(x, cos, sin, mask, slots, input_pos)
        return self.norm(x)

    def forward_full(self, x: Tensor) -> Tensor:
        """Cache-free causal forward from position 0. x (B, T, D) -> hidden (B, T, D)."""
        length = x.shape[1]
        assert length <= self.max_seq_len, f"{length} positions > max_seq_len {self.max_seq_len}"
        cos, sin = self.rope_cos[:length], self.rope_sin[:length]  # (T, hd)
        for layer in self.layers:
            x = layer(x, cos, sin, None, None, None)
        return self.norm(x)


class Qwen2ForCausalLM(nn.Module):
    """Backbone plus `lm_head`, nested as in HF so the checkpoint keys match (`model.*`, `lm_head.weight`).

    CosyVoice2 reads its logits from its own speech head; `lm_head` is kept only so that strict loading
    accepts the checkpoint. With tied embeddings it shares `embed_tokens.weight` and costs no memory."""

    def __init__(self, config: Qwen2Config, max_seq_len: int):
        super().__init__()
        self.model = Qwen2Decoder(config, max_seq_len)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
