"""Prepared examples -> a train/validation split and padded batches, the same on every rank.

Batches: each epoch the examples are shuffled by a generator seeded with (seed, epoch), then cut into
batches of at most `batch_size` rows and, when `max_tokens` is set, at most `max_tokens` padded speech
tokens (rows x longest row). Under torchrun each rank takes every world-th batch (as DistributedSampler
shards examples), all ranks the same number, so their optimizer steps stay in lockstep.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from cosyvoice_triton.training.data_prep import Example
from cosyvoice_triton.training.losses import FlowBatch, LMBatch


@dataclass
class Batch:
    lm: LMBatch
    flow: FlowBatch

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.lm.to(device), self.flow.to(device))


def split_train_val(examples: list[Example], val_share: float) -> tuple[list[Example], list[Example]]:
    """A held-out share (at least one example when there are two or more), chosen by a hash of each name,
    so that adding recordings never moves an old one between the two sides."""
    def rank(example: Example) -> str:
        return hashlib.sha256(example.name.encode()).hexdigest()

    n_val = 0 if len(examples) < 2 or val_share <= 0 else max(1, round(val_share * len(examples)))
    held_out = {e.name for e in sorted(examples, key=rank)[:n_val]}
    return [e for e in examples if e.name not in held_out], [e for e in examples if e.name in held_out]


def collate(examples: list[Example], token_mel_ratio: int = 2) -> Batch:
    """Right-padded tensors for both losses; the mel is padded to token_mel_ratio x the longest token row."""
    text = [torch.from_numpy(e.text_token) for e in examples]
    instruct = [torch.from_numpy(e.instruct_token) for e in examples]  # (0,) each without an instruct
    speech = [torch.from_numpy(e.speech_token) for e in examples]
    text_len = torch.tensor([t.numel() for t in text])
    instruct_len = torch.tensor([t.numel() for t in instruct])
    speech_len = torch.tensor([s.numel() for s in speech])
    speech_padded = pad_sequence(speech, batch_first=True)  # (B, T)
    mel = torch.zeros(len(examples), token_mel_ratio * speech_padded.size(1), examples[0].speech_feat.shape[1])
    for row, example in enumerate(examples):
        mel[row, : example.speech_feat.shape[0]] = torch.from_numpy(example.speech_feat)
    embedding = torch.stack([torch.from_numpy(e.embedding) for e in examples])  # (B, 192)
    return Batch(lm=LMBatch(pad_sequence(text, batch_first=True), text_len, speech_padded, speech_len,
                            pad_sequence(instruct, batch_first=True), instruct_len),
                 flow=FlowBatch(speech_padded, speech_len, mel, embedding))


def epoch_batches(lengths: list[int], epoch: int, seed: int, batch_size: int, max_tokens: int = 0,
                  rank: int = 0, world_size: int = 1) -> list[list[int]]:
    """Index lists of this rank's batches in `epoch` (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        grown = max(longest, lengths[index])
        full = len(current) == batch_size or (max_tokens > 0 and grown * (len(current) + 1) > max_tokens)
        if current and full:
            batches.append(current)
            current, grown = [], lengths[index]
        current.append(index)
        longest = grown
    if current:
        batches.append(current)
    while len(batches) < world_size:  # fewer batches than ranks: repeat, as DistributedSampler pads
        batches += batches[: world_size - len(batches)]
    per_rank = len(batches) // world_size
    return batches[rank::world_size][:per_rank]
