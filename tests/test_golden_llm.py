"""The speech LM against the official outputs in the golden set (see ../shared/golden/README.md)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.runtime.sampling import greedy_sampler

ATOL = 1e-4  # README: LLM logits / log-probs, 1e-4 absolute


@pytest.fixture(scope="module")
def golden_inputs(golden: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    names = ("in_text_token", "in_prompt_text_token", "in_prompt_speech_token", "llm_forced_speech_token")
    return {name: torch.from_numpy(golden[name]) for name in names}


@pytest.fixture(scope="module")
def model(golden_model_dir: Path, golden: dict[str, np.ndarray]) -> SpeechLM:
    needed = golden["llm_lm_input"].shape[1] + golden["llm_forced_speech_token"].shape[1]
    return SpeechLM.from_model_dir(golden_model_dir, max_batch=2, max_seq_len=needed + 64)


@pytest.fixture(scope="module")
def lm_input(model: SpeechLM, golden_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.build_prompt(golden_inputs["in_text_token"], golden_inputs["in_prompt_text_token"],
                              golden_inputs["in_prompt_speech_token"])


def max_abs(actual: torch.Tensor, expected: np.ndarray) -> float:
    assert tuple(actual.shape) == expected.shape
    return float((actual - torch.from_numpy(expected)).abs().max())


def test_lm_input(lm_input: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    assert max_abs(lm_input, golden["llm_lm_input"]) <= ATOL


def test_length_limits(model: SpeechLM, golden: dict[str, np.ndarray]) -> None:
    text_len = golden["in_text_token"].shape[1]
    assert model.length_limits(text_len) == (int(golden["llm_min_len"]), int(golden["llm_max_len"]))


def test_logits_oneshot(model: SpeechLM, lm_input: torch.Tensor, golden_inputs: dict[str, torch.Tensor],
                        golden: dict[str, np.ndarray]) -> None:
    forced = golden_inputs["llm_forced_speech_token"]
    sequence = torch.cat([lm_input, model.embed_speech(forced)], dim=1)  # (1, L + Nf, D)
    assert max_abs(model.logits_full(sequence), golden["llm_logits_oneshot"]) <= ATOL


def test_logits_stepwise(model: SpeechLM, lm_input: torch.Tensor, golden_inputs: dict[str, torch.Tensor],
                         golden: dict[str, np.ndarray]) -> None:
    """Prefill lm_input, then one cached step per forced token, as the official inference loop does."""
    forced = golden_inputs["llm_forced_speech_token"]
    prompt_len = lm_input.shape[1]
    slots = torch.tensor([1])  # any slot: use the second one so slot 0 is not assumed
    rows = [model.step_logits(lm_input, torch.arange(prompt_len)[None], slots)]
    for k in range(forced.shape[1]):
        step_input = model.embed_speech(forced[:, k:k + 1])  # (1, 1, D)
        rows.append(model.step_logits(step_input, torch.tensor([[prompt_len + k]]), slots))
    logits = torch.cat(rows)  # (Nf + 1, V)
    assert max_abs(logits, golden["llm_logits_stepwise"]) <= ATOL
    assert max_abs(logits.log_softmax(dim=-1), golden["llm_logp_stepwise"]) <= ATOL


def test_greedy_tokens(model: SpeechLM, golden_inputs: dict[str, torch.Tensor],
                       golden: dict[str, np.ndarray]) -> None:
    expected = golden["llm_greedy_tokens"].tolist()
    tokens = model.generate(golden_inputs["in_text_token"], golden_inputs["in_prompt_text_token"],
                            golden_inputs["in_prompt_speech_token"], sampler=greedy_sampler)
    got = [token for _, token in zip(expected, tokens)]
    assert got == expected
