"""HiFT loading and inference properties on the golden checkpoint (its outputs: test_golden.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.models.hift import HiFTGenerator, fold_weight_norm
from cosyvoice_triton.models.hift_source import GeneratorNoise, StackedNoise, ZeroNoise

WAVE_ATOL = 1e-3  # the golden set's waveform tolerance


@pytest.fixture(scope="module")
def hift(golden_model_dir: Path) -> HiFTGenerator:
    return HiFTGenerator.from_model_dir(golden_model_dir)


@pytest.fixture(scope="module")
def mel(golden: dict[str, np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(golden["hift_in_mel"])  # (1, 80, T)


def test_folded_weight_is_g_times_unit_v(golden_model_dir: Path) -> None:
    state = torch.load(golden_model_dir / "hift.pt", weights_only=True)
    g, v = (state[f"ups.0.parametrizations.weight.original{i}"] for i in (0, 1))  # ConvTranspose: g is (in, 1, 1)
    folded, modules = fold_weight_norm(state)
    expected = g * v / v.flatten(1).norm(dim=1)[:, None, None]
    torch.testing.assert_close(folded["ups.0.weight"], expected, rtol=1e-6, atol=1e-7)
    assert len(modules) == sum(k.endswith(".original0") for k in state)


def test_strict_loading_rejects_missing_and_unexpected_keys(hift: HiFTGenerator, golden_model_dir: Path,
                                                            tmp_path: Path) -> None:
    state = torch.load(golden_model_dir / "hift.pt", weights_only=True)
    cases = {
        "missing_plain": {k: v for k, v in state.items() if k != "source_downs.0.bias"},
        "missing_pair": {k: v for k, v in state.items() if not k.startswith("conv_post.parametrizations")},
        "half_pair": {k: v for k, v in state.items() if k != "conv_pre.parametrizations.weight.original0"},
        "unexpected": {**state, "extra.weight": torch.zeros(1)},
    }
    for name, broken in cases.items():
        torch.save(broken, tmp_path / f"{name}.pt")
        with pytest.raises((RuntimeError, ValueError)):
            HiFTGenerator(hift.config).load_hift_state(tmp_path / f"{name}.pt")


def test_cache_source_overwrites_the_start(hift: HiFTGenerator, mel: torch.Tensor) -> None:
    cache = torch.full((1, 1, 1000), 0.5)
    _, source = hift.inference(mel, cache, ZeroNoise())
    _, plain = hift.inference(mel, None, ZeroNoise())
    assert torch.equal(source[:, :, :1000], cache) and torch.equal(source[:, :, 1000:], plain[:, :, 1000:])


def test_batch_rows_are_independent(hift: HiFTGenerator, mel: torch.Tensor) -> None:
    other = mel.flip(2) + 0.3
    batch = torch.cat([mel, other])
    speech, source = hift.inference(batch, None, StackedNoise([GeneratorNoise.seeded(1), GeneratorNoise.seeded(2)]))
    # Batched convolutions round differently (f0 moves ~1e-4 Hz), so rows match to the golden tolerance, not bitwise.
    for row, (m, seed) in enumerate(((mel, 1), (other, 2))):
        solo_speech, solo_source = hift.inference(m, None, GeneratorNoise.seeded(seed))
        torch.testing.assert_close(speech[row:row + 1], solo_speech, rtol=0, atol=WAVE_ATOL)
        torch.testing.assert_close(source[row:row + 1], solo_source, rtol=0, atol=WAVE_ATOL)
