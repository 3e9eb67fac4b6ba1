"""The flow model against the official outputs in the golden set (see ../shared/golden/README.md)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_triton.config import read_yaml
from cosyvoice_triton.models.flow import FlowConfig, FlowMatching, FlowModel

MEL_ATOL = 1e-4  # README: flow mel, fp32, 1e-4 absolute


@pytest.fixture(scope="module")
def flow(golden_model_dir) -> FlowModel:
    return FlowModel.from_model_dir(golden_model_dir)


def run_flow(flow: FlowModel, golden: dict, n_tokens: int, streaming: bool, finalize: bool) -> np.ndarray:
    """The golden flow call on the first `n_tokens` of `flow_token` (B = 1)."""
    prompt_token = torch.from_numpy(golden["in_prompt_speech_token"])
    prompt_feat = torch.from_numpy(golden["in_prompt_feat"])
    token = torch.from_numpy(golden["flow_token"][:, :n_tokens])
    length = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    mel = flow.inference(token, length(n_tokens), prompt_token, length(prompt_token.shape[1]),
                         prompt_feat, length(prompt_feat.shape[1]), torch.from_numpy(golden["in_embedding"]),
                         streaming=streaming, finalize=finalize)
    return mel.numpy()


def assert_mel_close(actual: np.ndarray, expected: np.ndarray, name: str) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = float(np.abs(actual - expected).max())
    print(f"{name}: max abs error {err:.2e}")
    assert err <= MEL_ATOL, f"{name}: max abs error {err:.2e} > {MEL_ATOL}"


def test_state_dict_matches_checkpoint(flow: FlowModel, golden_model_dir) -> None:
    released = torch.load(golden_model_dir / "flow.pt", weights_only=True, map_location="cpu")
    assert set(flow.state_dict()) == set(released)


def test_fixed_noise(flow: FlowModel, golden: dict, golden_path) -> None:
    noise = flow.decoder.rand_noise.numpy()
    np.testing.assert_array_equal(noise, np.load(golden_path / "flow_rand_noise.npy"))
    first = golden["flow_rand_noise_first"]
    np.testing.assert_array_equal(noise[..., : first.shape[-1]], first)


def test_fixed_noise_does_not_reseed_global_rng(golden_model_dir) -> None:
    torch.manual_seed(1234)
    FlowMatching(FlowConfig.from_yaml(read_yaml(golden_model_dir / "cosyvoice2.yaml")))
    assert torch.initial_seed() == 1234


def test_nonstream(flow: FlowModel, golden: dict) -> None:
    mel = run_flow(flow, golden, golden["flow_token"].shape[1], streaming=False, finalize=True)
    assert_mel_close(mel, golden["flow_mel_nonstream"], "flow_mel_nonstream")


@pytest.mark.parametrize("chunk", [0, 1])
def test_stream_chunk(flow: FlowModel, golden: dict, chunk: int) -> None:
    n_tokens = int(golden["flow_stream_chunk_token_ends"][chunk])
    mel = run_flow(flow, golden, n_tokens, streaming=True, finalize=False)
    assert_mel_close(mel, golden[f"flow_mel_stream_chunk{chunk}"], f"flow_mel_stream_chunk{chunk}")


def test_final_stream_call_equals_nonstream(flow: FlowModel, golden: dict) -> None:
    """The last streaming call (all tokens, finalize, full attention) from the next token offset on."""
    offset = int(golden["flow_stream_chunk_token_ends"][-1]) - flow.config.pre_lookahead_len
    mel = run_flow(flow, golden, golden["flow_token"].shape[1], streaming=False, finalize=True)
    start = flow.config.token_mel_ratio * offset
    assert_mel_close(mel[:, :, start:], golden["flow_mel_nonstream"][:, :, start:], "final streaming call")


def test_output_lengths(flow: FlowModel, golden: dict) -> None:
    n_prompt = golden["in_prompt_speech_token"].shape[1]
    n_prompt_frames = golden["in_prompt_feat"].shape[1]
    for chunk, end in enumerate(golden["flow_stream_chunk_token_ends"]):
        frames = flow.output_lengths(torch.tensor([int(end)]), torch.tensor([n_prompt]),
                                     torch.tensor([n_prompt_frames]), finalize=False)
        assert frames.tolist() == [golden[f"flow_mel_stream_chunk{chunk}"].shape[-1]]
