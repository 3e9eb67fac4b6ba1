"""HiFT vocoder against the official outputs in the golden set (tolerances from its README)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.models.hift import HiFTConfig, HiFTGenerator, fold_weight_norm
from cosyvoice_triton.models.hift_source import GeneratorNoise, RecordedNoise, StackedNoise, ZeroNoise

WAVE_TOL = 1e-3
F0_TOL_HZ = 1e-3


@pytest.fixture(scope="module")
def hift(golden_model_dir: Path) -> HiFTGenerator:
    return HiFTGenerator.from_model_dir(golden_model_dir)


@pytest.fixture(scope="module")
def mel(golden: dict[str, np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(golden["hift_in_mel"])


def max_err(actual: torch.Tensor, expected: np.ndarray) -> float:
    assert tuple(actual.shape) == expected.shape
    return float(np.abs(actual.numpy() - expected).max())


def recorded_noise(golden: dict[str, np.ndarray]) -> RecordedNoise:
    return RecordedNoise(*(torch.from_numpy(golden[f"hift_seeded_{name}"])
                           for name in ("rand_ini", "sine_noise", "source_noise")))


def test_both_weight_norm_namings_load_identically(hift: HiFTGenerator, golden_model_dir: Path):
    legacy = HiFTGenerator(hift.config)
    legacy.load_hift_state(golden_model_dir / "extras" / "hift_legacy_weight_norm.pt")
    current, other = hift.state_dict(), legacy.state_dict()
    assert current.keys() == other.keys()
    for key in current:
        assert torch.equal(current[key], other[key]), key
    assert "conv_pre.weight" in current and not any("weight_g" in k or "parametrizations" in k for k in current)


def test_folded_weight_is_g_times_unit_v(golden_model_dir: Path):
    state = torch.load(golden_model_dir / "hift.pt", weights_only=True)
    g, v = (state[f"ups.0.parametrizations.weight.original{i}"] for i in (0, 1))  # ConvTranspose: g is (in, 1, 1)
    folded, modules = fold_weight_norm(state)
    expected = g * v / v.flatten(1).norm(dim=1)[:, None, None]
    torch.testing.assert_close(folded["ups.0.weight"], expected, rtol=1e-6, atol=1e-7)
    assert len(modules) == sum(k.endswith(".original0") for k in state)


def test_strict_loading_rejects_missing_and_unexpected_keys(hift: HiFTGenerator, golden_model_dir: Path,
                                                            tmp_path: Path):
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


def test_config_from_yaml(hift: HiFTGenerator):
    config = hift.config
    assert isinstance(config, HiFTConfig)
    assert config.samples_per_frame == 480 and config.sampling_rate == 24000  # fixed by the released model
    assert config.nb_harmonics + 1 == hift.m_source.l_linear.in_features


def test_f0(hift: HiFTGenerator, mel: torch.Tensor, golden: dict[str, np.ndarray]):
    with torch.inference_mode():
        f0 = hift.f0_predictor(mel)
    assert max_err(f0, golden["hift_f0"]) < F0_TOL_HZ


def test_zero_noise(hift: HiFTGenerator, mel: torch.Tensor, golden: dict[str, np.ndarray]):
    speech, source = hift.inference(mel, None, ZeroNoise())
    assert max_err(speech, golden["hift_zeronoise_speech"]) < WAVE_TOL
    assert max_err(source, golden["hift_zeronoise_source"]) < WAVE_TOL


def test_recorded_noise(hift: HiFTGenerator, mel: torch.Tensor, golden: dict[str, np.ndarray]):
    speech, source = hift.inference(mel, None, recorded_noise(golden))
    assert max_err(speech, golden["hift_seeded_speech"]) < WAVE_TOL
    assert max_err(source, golden["hift_seeded_source"]) < WAVE_TOL


def test_seeded_generator_follows_official_global_rng(hift: HiFTGenerator, mel: torch.Tensor,
                                                      golden: dict[str, np.ndarray], golden_meta: dict):
    seed = golden_meta["hift_seed"]
    noise = GeneratorNoise.seeded(seed)
    (_, length, harmonics) = golden["hift_seeded_sine_noise"].shape
    draws = (noise.initial_phase(1, harmonics, torch.device("cpu")),
             noise.sine_noise((1, length, harmonics), torch.device("cpu")),
             noise.source_noise((1, length, 1), torch.device("cpu")))
    for draw, name in zip(draws, ("rand_ini", "sine_noise", "source_noise")):
        assert np.array_equal(draw.numpy(), golden[f"hift_seeded_{name}"]), name

    speech, source = hift.inference(mel, None, GeneratorNoise.seeded(seed))
    assert max_err(speech, golden["hift_seeded_speech"]) < WAVE_TOL
    assert max_err(source, golden["hift_seeded_source"]) < WAVE_TOL


def test_cache_source_overwrites_the_start(hift: HiFTGenerator, mel: torch.Tensor):
    cache = torch.full((1, 1, 1000), 0.5)
    _, source = hift.inference(mel, cache, ZeroNoise())
    _, plain = hift.inference(mel, None, ZeroNoise())
    assert torch.equal(source[:, :, :1000], cache) and torch.equal(source[:, :, 1000:], plain[:, :, 1000:])


def test_batch_rows_are_independent(hift: HiFTGenerator, mel: torch.Tensor):
    other = mel.flip(2) + 0.3
    batch = torch.cat([mel, other])
    speech, source = hift.inference(batch, None, StackedNoise([GeneratorNoise.seeded(1), GeneratorNoise.seeded(2)]))
    # Batched convolutions round differently (f0 moves ~1e-4 Hz), so rows match to the golden tolerance, not bitwise.
    for row, (m, seed) in enumerate(((mel, 1), (other, 2))):
        solo_speech, solo_source = hift.inference(m, None, GeneratorNoise.seeded(seed))
        torch.testing.assert_close(speech[row:row + 1], solo_speech, rtol=0, atol=WAVE_TOL)
        torch.testing.assert_close(source[row:row + 1], solo_source, rtol=0, atol=WAVE_TOL)
