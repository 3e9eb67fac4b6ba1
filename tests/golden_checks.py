"""What the two golden tests share (test_golden.py: CosyVoice2, test_golden_cv3.py: CosyVoice3): the golden
READMEs' tolerances, the registry that makes every array of a set checked, comparison helpers, and the
checks that are the same for both families (the speech LM, the ONNX stand-ins, the two weight-norm namings)."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from cosyvoice_triton.engines.onnx_session import input_names, open_session
from cosyvoice_triton.messages import FlowPrompt

# The READMEs' tolerances for a faithful fp32 implementation (max abs error).
LOGIT_ATOL = 1e-4  # LLM logits and log-probs
MEL_ATOL = 1e-4  # flow mel, offline and streaming chunks
WAVE_ATOL = 1e-3  # HiFT waveforms computed from the golden mel
F0_ATOL_HZ = 1e-3
CAMPPLUS_ATOL = 1e-5  # the speech-tokenizer stand-in must match exactly

E2E_ATOL, E2E_ATOL_LOOSE = 1e-3, 5e-3  # waveforms of our flow feeding our vocoder: the mel's error decides

INDEX = "{i}"  # in a registered name: the chunk index 0, 1, ... (a family of arrays)
INPUTS = frozenset({  # the arrays that only feed the models, in both sets
    "in_text_token", "in_prompt_text_token", "in_prompt_speech_token", "in_prompt_feat", "in_embedding",
    "llm_forced_speech_token", "flow_token", "hift_in_mel", "onnx_campplus_in", "onnx_tokenizer_in",
})


class Registry:
    """Which golden arrays (or chunk families, `name{i}`) the tests of one module compare against."""

    def __init__(self):
        self.checked: dict[str, list[str]] = defaultdict(list)  # array -> the tests comparing it

    def checks(self, *names: str):
        """Register the golden arrays a test compares against; `name{i}` stands for name0, name1, ..."""
        def register(test):
            for name in names:
                self.checked[name].append(test.__name__)
            return test
        return register

    def assert_every_array_is_checked(self, golden: dict[str, np.ndarray], golden_path: Path) -> None:
        """Every array of the set is an input or checked, and every name registered is in the set."""
        arrays = set(golden) | {path.name for path in golden_path.glob("*.npy")}
        patterns = {name: name_pattern(name) for name in INPUTS | set(self.checked)}
        unclaimed = sorted(key for key in arrays if not any(p.fullmatch(key) for p in patterns.values()))
        assert not unclaimed, f"golden arrays that no test checks: {unclaimed}"
        absent = sorted(name for name, p in patterns.items() if not any(p.fullmatch(key) for key in arrays))
        assert not absent, f"named here but not in {golden_path}: {absent}"


def assert_close(actual: torch.Tensor | np.ndarray, expected: np.ndarray, atol: float, name: str) -> float:
    """Assert the shapes agree and the max abs error is <= atol; return the error."""
    if isinstance(actual, torch.Tensor):
        actual = actual.detach().cpu().numpy()
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = float(np.abs(actual.astype(np.float64) - expected).max(initial=0.0))
    print(f"{name}: max abs error {err:.2e}")
    assert err <= atol, f"{name}: max abs error {err:.2e} > {atol:.0e}"
    return err


def indexed(golden: dict[str, np.ndarray], family: str) -> list[np.ndarray]:
    """The arrays `family0`, `family1`, ... in numeric order (chunk10 after chunk9)."""
    pattern = re.compile(re.escape(family) + r"(\d+)")
    found = {int(m.group(1)): golden[key] for key in golden if (m := pattern.fullmatch(key))}
    assert sorted(found) == list(range(len(found))), f"{family}*: indices {sorted(found)} are not 0..n-1"
    return [found[i] for i in range(len(found))]


def name_pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(name).replace(re.escape(INDEX), r"\d+"))


def tensor(golden: dict[str, np.ndarray], key: str) -> torch.Tensor:
    return torch.from_numpy(golden[key])


def assert_json_describes_every_array(golden: dict[str, np.ndarray], golden_meta: dict) -> None:
    described = golden_meta["keys"]
    assert set(described) == set(golden)
    for key, array in golden.items():
        assert list(array.shape) == described[key]["shape"], key
        assert array.dtype == np.dtype(described[key]["dtype"]), key


# ---- the speech LM (one class for both families) ----------------------------------------------------

def llm_prompt(golden: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(text, prompt text, prompt speech) token ids, each (1, n)."""
    return tuple(tensor(golden, key) for key in ("in_text_token", "in_prompt_text_token", "in_prompt_speech_token"))


def stepwise_logits(llm, lm_input: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Prefill lm_input (1, L, D), then one cached step per forced token (1, F), as the official inference loop
    does; in cache slot 1, so that slot 0 is not assumed. -> logits (F + 1, V)."""
    prompt_len = lm_input.shape[1]
    slots = torch.tensor([1])
    rows = [llm.step_logits(lm_input, torch.arange(prompt_len)[None], slots)]
    for k in range(forced.shape[1]):
        rows.append(llm.step_logits(llm.embed_speech(forced[:, k:k + 1]), torch.tensor([[prompt_len + k]]), slots))
    return torch.cat(rows)


def check_llm_outputs(llm, lm_input: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    """The prompt frame, the length limits, one-shot and KV-cached logits and log-probs."""
    assert_close(lm_input, golden["llm_lm_input"], LOGIT_ATOL, "llm_lm_input")
    text_len = golden["in_text_token"].shape[1]
    assert llm.length_limits(text_len) == (int(golden["llm_min_len"]), int(golden["llm_max_len"]))
    forced = tensor(golden, "llm_forced_speech_token")  # (1, F)
    sequence = torch.cat([lm_input, llm.embed_speech(forced)], dim=1)  # (1, L + F, D)
    assert_close(llm.logits_full(sequence), golden["llm_logits_oneshot"], LOGIT_ATOL, "llm_logits_oneshot")
    logits = stepwise_logits(llm, lm_input, forced)  # (F + 1, V)
    assert_close(logits, golden["llm_logits_stepwise"], LOGIT_ATOL, "llm_logits_stepwise")
    assert_close(logits.log_softmax(dim=-1), golden["llm_logp_stepwise"], LOGIT_ATOL, "llm_logp_stepwise")


LLM_OUTPUTS = ("llm_lm_input", "llm_min_len", "llm_max_len", "llm_logits_oneshot", "llm_logits_stepwise",
               "llm_logp_stepwise")  # what check_llm_outputs compares


# ---- the flow (both families' flows take the same call) -----------------------------------------------

FLOW_CHUNK = "flow_mel_stream_chunk"
RAND_NOISE_FILE = "flow_rand_noise.npy"


def flow_prompt(golden: dict[str, np.ndarray]) -> FlowPrompt:
    return FlowPrompt(speech_tokens=tensor(golden, "in_prompt_speech_token"), mel=tensor(golden, "in_prompt_feat"),
                      embedding=tensor(golden, "in_embedding"))


def run_flow(flow, prompt: FlowPrompt, tokens: np.ndarray | torch.Tensor, streaming: bool, finalize: bool) -> torch.Tensor:
    """The READMEs' flow call on `tokens` (1, N): mel (1, 80, frames) without the prompt frames."""
    def length(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([x.shape[1]], dtype=torch.int32)

    token = torch.as_tensor(tokens)
    return flow.inference(token, length(token), prompt.speech_tokens, length(prompt.speech_tokens), prompt.mel,
                          length(prompt.mel), prompt.embedding, streaming=streaming, finalize=finalize)


def check_flow_keys_and_noise(flow, flow_pt: Path, golden: dict[str, np.ndarray], golden_path: Path) -> None:
    """The flow holds exactly flow.pt's keys, and its fixed noise is the official one (seed 0)."""
    released = torch.load(flow_pt, weights_only=True, map_location="cpu")
    assert set(flow.state_dict()) == set(released)
    noise = flow.decoder.rand_noise.numpy()
    np.testing.assert_array_equal(noise, np.load(golden_path / RAND_NOISE_FILE))
    first = golden["flow_rand_noise_first"]
    np.testing.assert_array_equal(noise[..., :first.shape[-1]], first)


def e2e_atol(calls: list, golden: dict[str, np.ndarray], ratio: int, tight_mel_atol: float) -> float:
    """The waveform tolerance the README allows for a run's mel error: each flow call (`.mel`, kept from
    `ratio * .offset`) against streaming chunk i, the final call against the offline mel; E2E_ATOL while the
    error is within `tight_mel_atol`, else E2E_ATOL_LOOSE."""
    references = indexed(golden, FLOW_CHUNK)[:len(calls) - 1] + [golden["flow_mel_nonstream"]]
    err = max(assert_close(call.mel, reference[:, :, ratio * call.offset:], MEL_ATOL, f"flow call {i}")
              for i, (call, reference) in enumerate(zip(calls, references, strict=True)))
    return E2E_ATOL if err <= tight_mel_atol else E2E_ATOL_LOOSE


# ---- the rest both families share -------------------------------------------------------------------

def assert_same_folded_weights(current: nn.Module, legacy: nn.Module) -> None:
    """Two vocoders loaded from the two weight-norm namings hold the same plain weights."""
    ours, other = current.state_dict(), legacy.state_dict()
    assert ours.keys() == other.keys()
    for key in ours:
        assert torch.equal(ours[key], other[key]), key
    assert "conv_pre.weight" in ours and not any("weight_g" in k or "parametrizations" in k for k in ours)


def check_onnx_standins(golden: dict[str, np.ndarray], campplus: Path, speech_tokenizer: Path) -> None:
    """How our code calls the two ONNX files: CAM++ by its one input, the tokenizer by feats and their length."""
    session = open_session(campplus, device="cpu")
    (name,) = input_names(session)
    out = session.run(None, {name: golden["onnx_campplus_in"]})[0]
    assert_close(out, golden["onnx_campplus_out"], CAMPPLUS_ATOL, "onnx_campplus_out")
    session = open_session(speech_tokenizer, device="cpu")
    feats_name, length_name = input_names(session)
    feats = golden["onnx_tokenizer_in"]  # (1, 128, T), all T frames valid
    out = session.run(None, {feats_name: feats, length_name: np.array([feats.shape[2]], np.int32)})[0]
    assert out.dtype == golden["onnx_tokenizer_out"].dtype
    np.testing.assert_array_equal(out, golden["onnx_tokenizer_out"])


ONNX_OUTPUTS = ("onnx_campplus_out", "onnx_tokenizer_out")  # what check_onnx_standins compares
