"""Batched flow calls: every row of a padded batch equals its own B = 1 call.

The rows take different slices of the golden tokens and different prompt lengths. Padding is filled with
junk (random token ids, large mel values) so a leak through the masks would show.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.models.flow import FlowModel

ROW_ATOL = 1e-4


@dataclass(frozen=True)
class Row:
    token: np.ndarray  # (T,)
    prompt_token: np.ndarray  # (Tp,)
    prompt_feat: np.ndarray  # (Tf, 80)


@pytest.fixture(scope="module")
def rows(golden: dict, flow: FlowModel) -> list[Row]:
    """A first streaming chunk, a later chunk with a shorter prompt, a whole utterance."""
    tokens, prompt_token = golden["flow_token"][0], golden["in_prompt_speech_token"][0]
    prompt_feat = golden["in_prompt_feat"][0]
    first_end, later_end = (int(e) for e in golden["flow_stream_chunk_token_ends"])
    short_prompt = prompt_token.shape[0] // 2 + 2
    ratio = flow.config.token_mel_ratio
    return [
        Row(tokens[:first_end], prompt_token, prompt_feat),
        Row(tokens[first_end // 3: later_end], prompt_token[:short_prompt], prompt_feat[: ratio * short_prompt]),
        Row(tokens, prompt_token[1:], prompt_feat[ratio:]),
    ]


def pad_stack(arrays: list[np.ndarray], junk: np.ndarray) -> torch.Tensor:
    """Right-pad to a common length along axis 0 with slices of `junk`."""
    width = max(a.shape[0] for a in arrays)
    return torch.from_numpy(np.stack([np.concatenate([a, junk[: width - a.shape[0]]]) for a in arrays]))


def run_batch(flow: FlowModel, golden: dict, batch: list[Row], streaming: bool | torch.Tensor,
              finalize: bool | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded call; returns the mel and each row's frame count."""
    rng = np.random.RandomState(0)
    junk_tokens = rng.randint(0, flow.config.vocab_size, size=512).astype(np.int32)
    junk_feat = (rng.randn(1024, flow.config.mel_bins) * 100).astype(np.float32)
    lengths = lambda arrays: torch.tensor([a.shape[0] for a in arrays], dtype=torch.int32)  # noqa: E731
    token, prompt_token, prompt_feat = ([getattr(row, field) for row in batch]
                                        for field in ("token", "prompt_token", "prompt_feat"))
    embedding = torch.from_numpy(np.repeat(golden["in_embedding"], len(batch), axis=0))
    embedding = embedding * torch.arange(1, len(batch) + 1)[:, None]  # a different norm per row
    mel = flow.inference(pad_stack(token, junk_tokens), lengths(token), pad_stack(prompt_token, junk_tokens),
                         lengths(prompt_token), pad_stack(prompt_feat, junk_feat), lengths(prompt_feat),
                         embedding, streaming=streaming, finalize=finalize)
    frames = flow.output_lengths(lengths(token), lengths(prompt_token), lengths(prompt_feat), finalize)
    return mel, frames


def assert_rows_match_solo(flow: FlowModel, golden: dict, batch: list[Row], streaming: list[bool],
                           finalize: list[bool], mel: torch.Tensor, frames: torch.Tensor) -> None:
    assert mel.shape == (len(batch), flow.config.mel_bins, int(frames.max()))
    for b, row in enumerate(batch):
        expected, _ = run_batch(flow, golden, [row], streaming[b], finalize[b])
        n = int(frames[b])
        assert expected.shape[-1] == n
        err = float((mel[b, :, :n] - expected[0]).abs().max())
        print(f"row {b}: {n} frames, max abs diff to B=1 {err:.2e}")
        assert err <= ROW_ATOL
        assert torch.all(mel[b, :, n:] == 0)


@pytest.mark.parametrize("streaming, finalize", [(True, False), (False, True)])
def test_batch_rows_equal_solo(flow: FlowModel, golden: dict, rows: list[Row], streaming: bool,
                               finalize: bool) -> None:
    batch = rows[:2]
    mel, frames = run_batch(flow, golden, batch, streaming, finalize)
    assert_rows_match_solo(flow, golden, batch, [streaming] * 2, [finalize] * 2, mel, frames)


def test_batch_with_per_row_flags(flow: FlowModel, golden: dict, rows: list[Row]) -> None:
    """A final call and two streaming chunks share one batch; the longest row comes first."""
    batch = [rows[2], rows[0], rows[1]]
    streaming, finalize = [False, True, True], [True, False, False]
    mel, frames = run_batch(flow, golden, batch, torch.tensor(streaming), torch.tensor(finalize))
    assert_rows_match_solo(flow, golden, batch, streaming, finalize, mel, frames)


def test_batched_first_chunk_matches_golden(flow: FlowModel, golden: dict, rows: list[Row]) -> None:
    mel, _ = run_batch(flow, golden, rows[:2], streaming=True, finalize=False)
    expected = torch.from_numpy(golden["flow_mel_stream_chunk0"][0])
    err = float((mel[0, :, : expected.shape[-1]] - expected).abs().max())
    print(f"batched chunk 0 vs golden: max abs error {err:.2e}")
    assert err <= ROW_ATOL


def test_invalid_inputs_name_the_field(flow: FlowModel, golden: dict, rows: list[Row]) -> None:
    row = rows[0]
    args = dict(token=torch.from_numpy(row.token[None]), token_len=torch.tensor([row.token.shape[0]]),
                prompt_token=torch.from_numpy(row.prompt_token[None]),
                prompt_token_len=torch.tensor([row.prompt_token.shape[0]]),
                prompt_feat=torch.from_numpy(row.prompt_feat[None]),
                prompt_feat_len=torch.tensor([row.prompt_feat.shape[0]]),
                embedding=torch.from_numpy(golden["in_embedding"]), streaming=True, finalize=False)
    with pytest.raises(InvalidInput) as bad_shape:
        flow.inference(**{**args, "prompt_feat": args["prompt_feat"][..., :-1]})
    assert bad_shape.value.field == "prompt_feat"
    with pytest.raises(InvalidInput) as too_short:  # the prompt frames outnumber the frames produced
        flow.inference(**{**args, "token_len": torch.tensor([0])})
    assert too_short.value.field == "token_len"
