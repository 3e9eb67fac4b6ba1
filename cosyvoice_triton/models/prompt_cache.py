"""The voice's share of every flow call, computed once: a bounded LRU of the flow cache over a prompt's
voice-final frames.

In a streaming call the mel frames of a 50-frame chunk depend only on the encoder output of that chunk and
the chunks before it, the prompt mel, the speaker embedding and the fixed noise (models/flow_cache.py). The
encoder output of a 25-token chunk depends on its tokens and `pre_lookahead_len` tokens after it. So the
chunks whose tokens and look-ahead all lie in the prompt depend only on the voice:
`voice_final_frames` = ratio * 25 * floor((P - 3) / 25) frames of a P-token prompt (75 tokens: 100 of
its 150 frames; the third chunk's look-ahead is new speech). A prompt of less than 28 tokens has none.
CosyVoice3's flow has no chunked encoder (models/dit_cache.py): a token's `mu` is final with its 3 look-ahead
tokens, so P - 3 tokens count, and the estimator's whole 50-frame chunks among their frames are the voice's.

The first streaming call of a stream computes those frames anyway; `cached_mel(..., voice_frames=...)` also
returns the stream's cache cut at them, which `PromptCache.store` keeps, and a later stream with the same
prompt starts from `PromptCache.seed`, so its first call computes only the frames after them (the same mel
as without the seed, within the per-stream cache's float rounding).

Key: a digest of what the flow receives (prompt token ids, prompt mel, embedding, as the flow casts them)
and the frame count, never a voice_id: two voices share an entry only if their content is identical, and a
prompt sent with a request hits as well. One `PromptCache` per flow model (the weights are not in the key).
Memory per voice: the per-stream cache's 1.15 MB per frame on the full-size config (fp32), so 115 MB for a
75-token prompt; the LRU evicts by bytes. Cached tensors are never written in place (a stream's cache grows
into new tensors), so a seeded stream shares them; a lock guards the LRU for callers on several threads.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch

from ..messages import FlowPrompt
from .flow import TokenToMel
from .flow_cache import FlowCacheSettings, StreamFlowCache

MB = 1 << 20


def voice_final_frames(flow: TokenToMel, prompt: FlowPrompt, max_frames: int) -> int:
    """The prompt's frames that depend only on the voice, in whole estimator chunks, within the prompt mel
    and at most the per-stream cache's `max_frames` (either family's flow: `TokenToMel.final_mu_tokens`)."""
    chunk = flow.decoder.estimator.config.static_chunk_size
    whole = flow.final_mu_tokens(prompt.speech_tokens.shape[-1])
    return min(flow.config.token_mel_ratio * whole, prompt.mel.shape[-2], max_frames) // chunk * chunk


def prompt_key(prompt: FlowPrompt, frames: int, dtype: torch.dtype = torch.float32) -> bytes:
    """Digest of the prompt as the flow receives it (token ids; mel and embedding in the flow's dtype)."""
    digest = hashlib.blake2b(digest_size=20)
    digest.update(f"{frames}|{dtype}".encode())
    for tensor in (prompt.speech_tokens.to(torch.int32), prompt.mel.to(dtype), prompt.embedding.to(dtype)):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.digest()


class PromptCache:
    """Voice caches by `prompt_key`, least recently used evicted first, at most `capacity_bytes` in all."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, StreamFlowCache] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = 0

    @classmethod
    def of_size_mb(cls, mb: float) -> PromptCache | None:
        """A cache of `mb` MB; None for 0 (off)."""
        if mb < 0:
            raise ValueError(f"prompt cache size {mb} MB < 0")
        return cls(int(mb * MB)) if mb > 0 else None

    def __len__(self) -> int:
        return len(self._entries)

    def seed(self, key: bytes) -> StreamFlowCache | None:
        """A new stream's cache starting from the voice's frames (sharing their tensors); None: not kept."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return StreamFlowCache(entry.frames, list(entry.steps))

    def store(self, key: bytes, voice: StreamFlowCache) -> None:
        """Keep a voice's cache (one larger than the whole capacity is not kept)."""
        size = voice.nbytes
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[key] = voice
            self.nbytes += size
            while self.nbytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes

    def open_stream(self, flow: TokenToMel, prompt: FlowPrompt, max_frames: int) -> StreamFlowCache:
        """A new stream's flow cache: seeded with the voice's frames when kept, else empty with the
        `voice_key` to store them under after its first streaming call (None: the prompt has no voice-final
        frames)."""
        frames = voice_final_frames(flow, prompt, max_frames)
        if frames == 0:
            return StreamFlowCache()
        key = prompt_key(prompt, frames, flow.spk_embed_affine_layer.weight.dtype)
        seeded = self.seed(key)
        return seeded if seeded is not None else StreamFlowCache(voice_key=key)


# ---- what a token2wav stage (token2wav/stream.py, token2wav/scheduler.py) does with it ----

def stage_prompt_cache(flow_cache: FlowCacheSettings | None, shared: PromptCache | None) -> PromptCache | None:
    """A stage's prompt cache: `shared` (another stage's) if given, else one of the settings' size; None while
    the per-stream flow cache is off (`flow_cache` None), since the voice's frames are a flow cache."""
    if flow_cache is None:
        return None
    return shared if shared is not None else PromptCache.of_size_mb(flow_cache.prompt_cache_mb)


def new_stream_cache(flow: TokenToMel, flow_cache: FlowCacheSettings | None, prompt_cache: PromptCache | None,
                     prompt: FlowPrompt) -> StreamFlowCache | None:
    """A new stream's flow cache (None: off), seeded with the voice's frames when the prompt cache has them."""
    if prompt_cache is not None:
        return prompt_cache.open_stream(flow, prompt, flow_cache.max_frames)
    return StreamFlowCache() if flow_cache is not None else None


def frames_to_store(flow: TokenToMel, flow_cache: FlowCacheSettings, prompt_cache: PromptCache | None,
                    prompt: FlowPrompt, cache: StreamFlowCache | None) -> int:
    """The voice-final frames a stream's call should also return for the prompt cache (`cached_mel`'s
    voice_frames): those of an empty cache marked with a voice_key; 0 for any other."""
    if prompt_cache is None or cache is None or cache.voice_key is None or cache.frames:
        return 0
    return voice_final_frames(flow, prompt, flow_cache.max_frames)
