"""The LLM scheduler's decode step replayed from CUDA graphs, one per (slot-count bucket, attended cache length).

A decode round has B live rows (1 <= B <= max_batch), each at its own slot and position, attending over the
first `kv_len` cache positions (`qwen2.kv_bucket`: a multiple of 128). B is padded up to a power of two (or
max_batch) and the padded rows point at a scratch cache slot that no stream holds (the cache has
max_batch + 1 slots), at position 0: whatever they write there, no stream ever reads. So one graph per
(rows bucket, kv_len) serves every round of those sizes, and a row's logits are the eager step's up to the
rounding of a batch of another size. Graphs are captured on first use; `warm_up` captures the buckets of
the first cache lengths at load. Fallbacks as engines/cuda_graphs.py: eager after a failed capture.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import Tensor

from ..engines.cuda_graphs import Capture, GraphTable, bucket_for, pad_rows, power_buckets
from ..models.qwen2 import kv_bucket
from ..models.speech_lm import SpeechLM

WARM_POSITIONS = 1024  # warm_up() captures the kv_len buckets up to this many positions


class DecodeGraphs:
    """`step(tokens, input_pos, slots, kv_len)` as `SpeechLM.step_logits` on embedded speech tokens, from graphs.

    The model's cache must hold max_batch + 1 slots: slot max_batch is the padded rows' scratch slot."""

    def __init__(self, llm: SpeechLM, max_batch: int, capture: Capture | None = None):
        if llm.backbone.max_batch != max_batch + 1:
            raise ValueError(f"the KV cache has {llm.backbone.max_batch} slots; decode graphs need "
                             f"max_batch + 1 = {max_batch + 1} (a scratch slot)")
        self.llm = llm
        self.scratch_slot = max_batch
        self.row_buckets = power_buckets(max_batch)
        self.table = GraphTable("llm decode step", capture)

    def step(self, tokens: Tensor, input_pos: Tensor, slots: Tensor, kv_len: int) -> Tensor:
        """tokens, input_pos (B, 1) int64, slots (B,) int64 -> float32 logits (B, V)."""
        B = tokens.size(0)
        rows = bucket_for(B, self.row_buckets)
        graph = None if rows is None else self._graph(rows, kv_len, tokens.device)
        if graph is None:
            return self._eager(tokens, input_pos, slots, kv_len)
        logits = graph(pad_rows(tokens, rows), pad_rows(input_pos, rows), pad_rows(slots, rows, self.scratch_slot))
        return logits[:B].clone()  # (B, V): the graph's output is overwritten by the next replay

    def warm_up(self, kv_lens: Iterable[int] | None = None) -> int:
        """Capture every rows bucket for each of `kv_lens` (default: the cache lengths up to WARM_POSITIONS);
        the number of graphs held after."""
        device = self.llm.llm_decoder.weight.device
        max_seq_len = self.llm.max_seq_len
        if kv_lens is None:
            kv_lens = sorted({kv_bucket(n, max_seq_len) for n in range(1, min(WARM_POSITIONS, max_seq_len) + 1)})
        for kv_len in kv_lens:
            for rows in self.row_buckets:
                self._graph(rows, kv_len, device)
        return len(self.table.graphs)

    def warm_up_report(self) -> str:
        """`warm_up()` at load, and what came of it, for the start-up log and the benchmark's report."""
        start = time.perf_counter()
        captured = self.warm_up()
        if self.table.failure is not None:
            return f"eager after a failed capture ({self.table.failure})"
        return (f"{captured} decode-step buckets captured in {time.perf_counter() - start:.1f} s, "
                "more on first use")

    def _graph(self, rows: int, kv_len: int, device: torch.device):
        def example() -> tuple[Tensor, ...]:  # the capture's warm-up calls run the step: rows write the scratch slot
            return (torch.zeros(rows, 1, dtype=torch.int64, device=device),
                    torch.zeros(rows, 1, dtype=torch.int64, device=device),
                    torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=device))

        return self.table.get((rows, kv_len), lambda *inputs: self._eager(*inputs, kv_len), example)

    def _eager(self, tokens: Tensor, input_pos: Tensor, slots: Tensor, kv_len: int) -> Tensor:
        return self.llm.step_logits(self.llm.embed_speech(tokens), input_pos, slots, kv_len)  # (B, V)
