"""Our CosyVoice3 modules against every output of the official implementation in the CosyVoice3 golden folder.

The folder (`COSYVOICE_GOLDEN_CV3_DIR`, default tests/golden/cv3/tiny) holds a tiny CosyVoice3 checkpoint in
the released layout, the inputs, and what the official code computed from them; its README describes each
array and the tolerances used here. Dimensions come from the checkpoint, lengths and chunk counts from the
arrays, seeds and the thread count from golden.json, so the tests run unchanged on any folder with the same
keys (tests/test_golden_cv3_harness.py runs them on a folder of other dimensions and seeds).

Each test names the arrays it compares with `@checks(...)`; `INPUTS` names the arrays that only feed the
models. `test_every_golden_array_is_checked` fails when the folder holds an array that neither names.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.engines.onnx_session import input_names, open_session
from cosyvoice_triton.family import COSYVOICE3, family_of
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.messages import ChunkPolicy
from cosyvoice_triton.models.causal_hift import CausalHiFTGenerator
from cosyvoice_triton.models.dit_flow import DiTFlowModel
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.fixed_noise import cosyvoice3_draws, official_noise
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule
from cosyvoice_triton.token2wav.causal_vocoder_stream import CausalVocoderStream
from recorded_noise import RecordedNoise
from test_golden import INDEX, assert_close, indexed, name_pattern

REPO_ROOT = Path(__file__).resolve().parents[1]

# The README's tolerances for a faithful fp32 implementation (max abs error).
LOGIT_ATOL = 1e-4  # LLM logits and log-probs
MEL_ATOL = 1e-4  # flow mel, offline and streaming chunks
WAVE_ATOL = 1e-3  # HiFT waveforms computed from the golden mel
F0_ATOL_HZ = 1e-3
CAMPPLUS_ATOL = 1e-5  # the speech-tokenizer stand-in must match exactly
# End to end (our flow feeding our HiFT): 1e-3 while our mel is within 1e-5 of the golden mel, else 5e-3
# (the README: HiFT amplifies mel errors 4-40x).
E2E_ATOL, E2E_ATOL_LOOSE, E2E_MEL_ATOL = 1e-3, 5e-3, 1e-5

FLOW_CHUNK, HIFT_CHUNK, E2E_CHUNK = "flow_mel_stream_chunk", "hift_stream_chunk", "e2e_stream_chunk"
RAND_NOISE_FILE = "flow_rand_noise.npy"

INPUTS = frozenset({
    "in_text_token", "in_prompt_text_token", "in_prompt_speech_token", "in_prompt_feat", "in_embedding",
    "llm_forced_speech_token", "flow_token", "hift_in_mel", "onnx_campplus_in", "onnx_tokenizer_in",
})
CHECKED: dict[str, list[str]] = defaultdict(list)  # golden array (or family) -> the tests comparing it


def checks(*names: str):
    """Register the golden arrays a test compares against; `name{i}` stands for name0, name1, ..."""
    def register(test):
        for name in names:
            CHECKED[name].append(test.__name__)
        return test
    return register


def tensor(golden: dict[str, np.ndarray], key: str) -> torch.Tensor:
    return torch.from_numpy(golden[key])


# ---- the folder -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden_path() -> Path:
    path = Path(os.environ.get("COSYVOICE_GOLDEN_CV3_DIR", REPO_ROOT / "tests" / "golden" / "cv3" / "tiny"))
    if not (path / "golden.npz").exists():
        pytest.skip(f"CosyVoice3 golden set not found at {path} (set COSYVOICE_GOLDEN_CV3_DIR)")
    return path


@pytest.fixture(scope="module")
def golden(golden_path: Path) -> dict[str, np.ndarray]:
    with np.load(golden_path / "golden.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def golden_meta(golden_path: Path) -> dict:
    return json.loads((golden_path / "golden.json").read_text())


@pytest.fixture(scope="module")
def model_dir(golden_path: Path, golden_meta: dict) -> Path:
    return golden_path / golden_meta["model_dir"]


@pytest.fixture(scope="module", autouse=True)
def golden_threads(golden_meta: dict):
    """The thread count the golden outputs were computed with (a thread count changes float sums)."""
    before = torch.get_num_threads()
    torch.set_num_threads(golden_meta["threads"])
    yield
    torch.set_num_threads(before)


def test_every_golden_array_is_checked(golden: dict[str, np.ndarray], golden_path: Path) -> None:
    arrays = set(golden) | {path.name for path in golden_path.glob("*.npy")}
    patterns = {name: name_pattern(name) for name in INPUTS | set(CHECKED)}
    unclaimed = sorted(key for key in arrays if not any(p.fullmatch(key) for p in patterns.values()))
    assert not unclaimed, f"golden arrays that no test checks: {unclaimed}"
    absent = sorted(name for name, p in patterns.items() if not any(p.fullmatch(key) for key in arrays))
    assert not absent, f"named here but not in {golden_path}: {absent}"


def test_golden_json_describes_every_array(golden: dict[str, np.ndarray], golden_meta: dict) -> None:
    described = golden_meta["keys"]
    assert set(described) == set(golden)
    for key, array in golden.items():
        assert list(array.shape) == described[key]["shape"], key
        assert array.dtype == np.dtype(described[key]["dtype"]), key


def test_the_folder_is_cosyvoice3(model_dir: Path) -> None:
    assert family_of(model_dir) is COSYVOICE3
    models = family_models(model_dir)
    assert (models.flow, models.vocoder) == (DiTFlowModel, CausalHiFTGenerator)


# ---- speech LM --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(model_dir: Path, golden: dict[str, np.ndarray]) -> SpeechLM:
    decoded = max(golden["llm_forced_speech_token"].shape[1], golden["llm_greedy_tokens"].shape[0])
    return family_models(model_dir).load_llm(model_dir, max_batch=2,
                                              max_seq_len=golden["llm_lm_input"].shape[1] + decoded + 2)


@pytest.fixture(scope="module")
def llm_prompt(golden: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(text, prompt text, prompt speech) token ids, each (1, n)."""
    return tuple(tensor(golden, key) for key in ("in_text_token", "in_prompt_text_token", "in_prompt_speech_token"))


@pytest.fixture(scope="module")
def lm_input(llm: SpeechLM, llm_prompt) -> torch.Tensor:
    return llm.build_prompt(*llm_prompt)  # (1, L, D)


@checks("llm_lm_input")
def test_lm_input(lm_input: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    assert_close(lm_input, golden["llm_lm_input"], LOGIT_ATOL, "llm_lm_input")


def test_lm_needs_end_of_prompt(llm: SpeechLM, llm_prompt) -> None:
    from cosyvoice_triton.errors import InvalidInput

    text, prompt_text, prompt_speech = llm_prompt
    marker = llm.config.layout.required_text_id
    with pytest.raises(InvalidInput, match="prompt_text_token"):
        llm.build_prompt(text, prompt_text[prompt_text != marker][None], prompt_speech)


@checks("llm_min_len", "llm_max_len")
def test_length_limits(llm: SpeechLM, golden: dict[str, np.ndarray]) -> None:
    text_len = golden["in_text_token"].shape[1]
    assert llm.length_limits(text_len) == (int(golden["llm_min_len"]), int(golden["llm_max_len"]))


@checks("llm_logits_oneshot")
def test_logits_oneshot(llm: SpeechLM, lm_input: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    sequence = torch.cat([lm_input, llm.embed_speech(tensor(golden, "llm_forced_speech_token"))], dim=1)  # (1, L + F, D)
    assert_close(llm.logits_full(sequence), golden["llm_logits_oneshot"], LOGIT_ATOL, "llm_logits_oneshot")


@checks("llm_logits_stepwise", "llm_logp_stepwise")
def test_logits_stepwise(llm: SpeechLM, lm_input: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    """Prefill lm_input, then one cached step per forced token, as the official inference loop does."""
    forced = tensor(golden, "llm_forced_speech_token")  # (1, F)
    prompt_len = lm_input.shape[1]
    slots = torch.tensor([1])  # the second cache slot, so that slot 0 is not assumed
    rows = [llm.step_logits(lm_input, torch.arange(prompt_len)[None], slots)]
    for k in range(forced.shape[1]):
        rows.append(llm.step_logits(llm.embed_speech(forced[:, k:k + 1]), torch.tensor([[prompt_len + k]]), slots))
    logits = torch.cat(rows)  # (F + 1, V)
    assert_close(logits, golden["llm_logits_stepwise"], LOGIT_ATOL, "llm_logits_stepwise")
    assert_close(logits.log_softmax(dim=-1), golden["llm_logp_stepwise"], LOGIT_ATOL, "llm_logp_stepwise")


@checks("llm_greedy_tokens", "llm_greedy_stop")
def test_greedy_tokens_and_stop(llm: SpeechLM, llm_prompt, golden: dict[str, np.ndarray]) -> None:
    """Argmax decoding as the official loop does it: while fewer than min_len tokens are out, only index
    `speech_token_size` (SOS in CosyVoice3) is masked, so a stop id may end decoding before min_len."""
    expected, stop = golden["llm_greedy_tokens"].tolist(), int(golden["llm_greedy_stop"])
    sampled: list[int] = []

    def greedy(logp: torch.Tensor, decoded, generator) -> int:
        sampled.append(int(logp.argmax()))
        return sampled[-1]

    tokens = list(islice(generate(llm, *llm_prompt, sampler=greedy), len(expected) + 1))
    assert tokens[:len(expected)] == expected
    if stop >= 0:  # decoding ended on `stop`: it was sampled, not yielded
        assert tokens == expected and sampled[-1] == stop and stop in llm.config.stop_tokens


# ---- flow -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    speech_tokens: torch.Tensor  # (1, P) int32
    mel: torch.Tensor  # (1, 2P, 80)
    embedding: torch.Tensor  # (1, 192)


@pytest.fixture(scope="module")
def flow(model_dir: Path) -> DiTFlowModel:
    return family_models(model_dir).load_flow(model_dir)


@pytest.fixture(scope="module")
def prompt(golden: dict[str, np.ndarray]) -> Prompt:
    return Prompt(tensor(golden, "in_prompt_speech_token"), tensor(golden, "in_prompt_feat"),
                  tensor(golden, "in_embedding"))


def run_flow(flow: DiTFlowModel, prompt: Prompt, tokens: np.ndarray | torch.Tensor, streaming: bool,
             finalize: bool) -> torch.Tensor:
    """The README's flow call on `tokens` (1, N): mel (1, 80, frames) without the prompt frames."""
    def length(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([x.shape[1]], dtype=torch.int32)

    token = torch.as_tensor(tokens)
    return flow.inference(token, length(token), prompt.speech_tokens, length(prompt.speech_tokens), prompt.mel,
                          length(prompt.mel), prompt.embedding, streaming=streaming, finalize=finalize)


def test_flow_state_dict_matches_checkpoint(flow: DiTFlowModel, model_dir: Path) -> None:
    released = torch.load(model_dir / "flow.pt", weights_only=True, map_location="cpu")
    assert set(flow.state_dict()) == set(released)


@checks(RAND_NOISE_FILE, "flow_rand_noise_first")
def test_fixed_flow_noise(flow: DiTFlowModel, golden: dict[str, np.ndarray], golden_path: Path) -> None:
    noise = flow.decoder.rand_noise.numpy()
    np.testing.assert_array_equal(noise, np.load(golden_path / RAND_NOISE_FILE))
    first = golden["flow_rand_noise_first"]
    np.testing.assert_array_equal(noise[..., :first.shape[-1]], first)


@checks("flow_mel_nonstream")
def test_flow_offline(flow: DiTFlowModel, prompt: Prompt, golden: dict[str, np.ndarray]) -> None:
    mel = run_flow(flow, prompt, golden["flow_token"], streaming=False, finalize=True)
    assert_close(mel, golden["flow_mel_nonstream"], MEL_ATOL, "flow_mel_nonstream")


@checks(f"{FLOW_CHUNK}{INDEX}", "flow_stream_chunk_token_ends")
def test_flow_streaming_chunks(flow: DiTFlowModel, prompt: Prompt, golden: dict[str, np.ndarray]) -> None:
    """Chunk attention, and finalize=False: the last pre_lookahead_len tokens make no frames."""
    ends = golden["flow_stream_chunk_token_ends"].tolist()
    for i, (end, expected) in enumerate(zip(ends, indexed(golden, FLOW_CHUNK), strict=True)):
        mel = run_flow(flow, prompt, golden["flow_token"][:, :end], streaming=True, finalize=False)
        assert mel.shape[-1] == flow.config.token_mel_ratio * (prompt.speech_tokens.shape[1] + end
                                                               - flow.config.pre_lookahead_len) - prompt.mel.shape[1]
        assert_close(mel, expected, MEL_ATOL, f"{FLOW_CHUNK}{i}")


def test_flow_rows_of_a_batch_equal_their_solo_runs(flow: DiTFlowModel, prompt: Prompt,
                                                     golden: dict[str, np.ndarray]) -> None:
    """Two right-padded rows (a streaming chunk and the offline call) in one batch give their solo mels."""
    ends = golden["flow_stream_chunk_token_ends"].tolist()
    tokens = torch.from_numpy(golden["flow_token"])
    short, full = tokens[:, :ends[0]], tokens
    batch = torch.zeros(2, full.shape[1], dtype=full.dtype)
    batch[0, :short.shape[1]], batch[1] = short[0], full[0]
    two = lambda x: x.expand(2, *x.shape[1:])  # noqa: E731 - the same prompt on both rows
    lengths = lambda n: torch.tensor(n, dtype=torch.int32)  # noqa: E731
    mel = flow.inference(batch, lengths([short.shape[1], full.shape[1]]), two(prompt.speech_tokens),
                         lengths([prompt.speech_tokens.shape[1]] * 2), two(prompt.mel), lengths([prompt.mel.shape[1]] * 2),
                         two(prompt.embedding), streaming=torch.tensor([True, False]),
                         finalize=torch.tensor([False, True]))
    chunk0 = golden[f"{FLOW_CHUNK}0"]
    assert_close(mel[:1, :, :chunk0.shape[-1]], chunk0, MEL_ATOL, "batched streaming row")
    assert_close(mel[1:], golden["flow_mel_nonstream"], MEL_ATOL, "batched offline row")


# ---- HiFT -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hift(model_dir: Path) -> CausalHiFTGenerator:
    return family_models(model_dir).load_vocoder(model_dir)


@pytest.fixture(scope="module")
def hift_mel(golden: dict[str, np.ndarray]) -> torch.Tensor:
    return tensor(golden, "hift_in_mel")  # (1, 80, T)


def recorded_noise(golden: dict[str, np.ndarray]) -> RecordedNoise:
    return RecordedNoise(*(tensor(golden, f"hift_fixed_{draw}") for draw in ("rand_ini", "sine_noise", "source_noise")))


def test_hift_weight_norm_namings_load_identically(hift: CausalHiFTGenerator, model_dir: Path) -> None:
    legacy = CausalHiFTGenerator(hift.config)
    legacy.load_hift_state(model_dir / "extras" / "hift_legacy_weight_norm.pt")
    current, other = hift.state_dict(), legacy.state_dict()
    assert current.keys() == other.keys()
    for key in current:
        assert torch.equal(current[key], other[key]), key
    assert "conv_pre.weight" in current and not any("weight_g" in k or "parametrizations" in k for k in current)


def test_hift_config_matches_the_arrays(hift: CausalHiFTGenerator, golden: dict[str, np.ndarray],
                                        golden_meta: dict) -> None:
    config = hift.config
    assert config.sampling_rate == golden_meta["sample_rate"]
    assert config.samples_per_frame * golden["hift_in_mel"].shape[-1] == golden["hift_speech"].shape[-1]
    assert config.nb_harmonics + 1 == hift.m_source.l_linear.in_features == golden["hift_fixed_rand_ini"].shape[-1]


@checks("hift_f0")
def test_hift_f0(hift: CausalHiFTGenerator, hift_mel: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    """F0 in float64 (the predictor's own dtype), then float32, as the official inference."""
    assert hift.f0_predictor.classifier.weight.dtype == torch.float64
    with torch.inference_mode():
        f0 = hift.f0_predictor(hift_mel.double()).float()
    assert_close(f0, golden["hift_f0"], F0_ATOL_HZ, "hift_f0")


@checks("hift_zeronoise_speech", "hift_zeronoise_source")
def test_hift_zero_noise(hift: CausalHiFTGenerator, hift_mel: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    speech, source = hift.inference(hift_mel, finalize=True, noise=ZeroNoise())
    assert_close(speech, golden["hift_zeronoise_speech"], WAVE_ATOL, "hift_zeronoise_speech")
    assert_close(source, golden["hift_zeronoise_source"], WAVE_ATOL, "hift_zeronoise_source")


@checks("hift_speech", "hift_source")
def test_hift_recorded_fixed_noise(hift: CausalHiFTGenerator, hift_mel: torch.Tensor,
                                   golden: dict[str, np.ndarray]) -> None:
    speech, source = hift.inference(hift_mel, finalize=True, noise=recorded_noise(golden))
    assert_close(speech, golden["hift_speech"], WAVE_ATOL, "hift_speech")
    assert_close(source, golden["hift_source"], WAVE_ATOL, "hift_source")


@checks("hift_speech", "hift_source")
def test_hift_own_fixed_noise_draws_nothing(hift: CausalHiFTGenerator, hift_mel: torch.Tensor,
                                            golden: dict[str, np.ndarray], golden_meta: dict) -> None:
    """The vocoder's own noise (drawn when loaded) gives the official output; inference leaves torch's RNG
    as it was (the README's `hift_seed` seeds it first)."""
    torch.manual_seed(golden_meta["hift_seed"])
    state = torch.get_rng_state()
    speech, source = hift.inference(hift_mel, finalize=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert_close(speech, golden["hift_speech"], WAVE_ATOL, "hift_speech (own noise)")
    assert_close(source, golden["hift_source"], WAVE_ATOL, "hift_source (own noise)")


@checks("hift_fixed_rand_ini", "hift_fixed_sine_noise", "hift_fixed_source_noise")
def test_fixed_noise_replays_the_official_draws(flow: DiTFlowModel, hift: CausalHiFTGenerator,
                                                golden: dict[str, np.ndarray]) -> None:
    """The noise tensors come from torch's generator after the seed-0 reset and the draws of the modules the
    official code builds in between, with this checkpoint's dimensions."""
    f, h = flow.config, hift.config
    draws = cosyvoice3_draws(f.mel_bins, f.noise_frames, f.vocab_size, f.input_size, f.spk_embed_dim,
                             h.f0_in_channels, h.f0_cond_channels, h.f0_num_class)
    samples = golden["hift_fixed_sine_noise"].shape[1]
    rand_ini, sine, uv = official_noise(draws, samples)
    for name, ours in (("rand_ini", rand_ini), ("sine_noise", sine), ("source_noise", uv)):
        np.testing.assert_array_equal(ours.numpy(), golden[f"hift_fixed_{name}"], err_msg=name)
    cpu = torch.device("cpu")
    np.testing.assert_array_equal(hift.noise.initial_phase(1, sine.shape[-1], cpu).numpy(), golden["hift_fixed_rand_ini"])
    np.testing.assert_array_equal(hift.noise.sine_noise(tuple(sine.shape), cpu).numpy(), golden["hift_fixed_sine_noise"])


@checks("hift_stream_mel_ends", f"{HIFT_CHUNK}{INDEX}")
def test_hift_streaming(hift: CausalHiFTGenerator, hift_mel: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    """The official token2wav's vocoding: each call on all the mel so far, the samples after those sent."""
    ends = golden["hift_stream_mel_ends"].tolist()
    stream, start = CausalVocoderStream(hift), 0
    outputs = []
    for i, end in enumerate(ends):
        outputs.append(stream.push(hift_mel[:, :, start:end], finalize=i == len(ends) - 1))
        start = end
    held = hift.config.held_back_frames * hift.config.samples_per_frame
    assert outputs[0].shape[-1] == ends[0] * hift.config.samples_per_frame - held
    for i, (audio, expected) in enumerate(zip(outputs, indexed(golden, HIFT_CHUNK), strict=True)):
        assert_close(audio, expected, WAVE_ATOL, f"{HIFT_CHUNK}{i}")
    assert stream.closed and stream.mel is None


# ---- end to end: the official streaming schedule, our flow feeding our vocoder --------------------------

@dataclass
class FlowCall:
    n_tokens: int  # tokens given to the flow (all so far)
    offset: int  # the mel is kept from token_mel_ratio * offset on
    streaming: bool
    mel: torch.Tensor  # (1, 80, frames) the kept frames


@dataclass
class Run:
    chunks: list[torch.Tensor]  # audio chunks (1, N)
    calls: list[FlowCall]


def official_policy(flow: DiTFlowModel) -> ChunkPolicy:
    """The family's chunk schedule with the checkpoint's look-ahead and attention chunk."""
    config = flow.config
    return replace(COSYVOICE3.chunk, lookahead=config.pre_lookahead_len,
                   chunk_tokens=config.estimator.static_chunk_size // config.token_mel_ratio)


def synthesize(flow: DiTFlowModel, hift: CausalHiFTGenerator, prompt: Prompt, tokens: torch.Tensor,
               policy: ChunkPolicy | None) -> Run:
    """`CosyVoice3Model.tts` on fixed tokens (the voice-conversion entry) with the vocoder noise zeroed: with a
    policy, non-final chunks on its schedule (chunk attention, finalize False), then a final full-attention
    call; without, one offline call."""
    stream, ratio = CausalVocoderStream(hift, noise=ZeroNoise()), flow.config.token_mel_ratio
    run, offset = Run([], []), 0
    if policy is not None:
        schedule = ChunkSchedule(policy, prompt.speech_tokens.shape[1])
        while schedule.needed <= tokens.shape[1]:
            start, end = schedule.advance()
            mel = run_flow(flow, prompt, tokens[:, :end], streaming=True, finalize=False)[:, :, ratio * start:]
            run.calls.append(FlowCall(end, start, True, mel))
            run.chunks.append(stream.push(mel, finalize=False))
            offset = schedule.offset
    mel = run_flow(flow, prompt, tokens, streaming=False, finalize=True)[:, :, ratio * offset:]
    run.calls.append(FlowCall(tokens.shape[1], offset, False, mel))
    run.chunks.append(stream.push(mel, finalize=True))
    return run


@pytest.fixture(scope="module")
def streaming_run(flow: DiTFlowModel, hift: CausalHiFTGenerator, prompt: Prompt, golden: dict[str, np.ndarray]) -> Run:
    return synthesize(flow, hift, prompt, tensor(golden, "flow_token"), official_policy(flow))


@checks("flow_stream_chunk_token_ends", "flow_stream_chunk_token_offsets", f"{FLOW_CHUNK}{INDEX}",
        "flow_mel_nonstream")
def test_streaming_flow_calls_follow_the_official_schedule(streaming_run: Run, golden: dict[str, np.ndarray],
                                                           flow: DiTFlowModel) -> None:
    """Non-final call i sees the first `ends[i]` tokens with chunk attention and keeps its mel from
    `offsets[i]` on; the final call starts where the last one stopped and equals the offline mel there."""
    ends, offsets = golden["flow_stream_chunk_token_ends"].tolist(), golden["flow_stream_chunk_token_offsets"].tolist()
    *partial, final = streaming_run.calls
    assert [(call.n_tokens, call.offset) for call in partial] == list(zip(ends, offsets, strict=True))
    ratio = flow.config.token_mel_ratio
    for i, (call, mel) in enumerate(zip(partial, indexed(golden, FLOW_CHUNK), strict=True)):
        assert_close(call.mel, mel[:, :, ratio * call.offset:], MEL_ATOL, f"streaming call {i}")
    assert (final.n_tokens, final.offset, final.streaming) == (golden["flow_token"].shape[1],
                                                                ends[-1] - flow.config.pre_lookahead_len, False)
    assert_close(final.mel, golden["flow_mel_nonstream"][:, :, ratio * final.offset:], MEL_ATOL, "final call")


def e2e_atol(run: Run, golden: dict[str, np.ndarray], ratio: int) -> float:
    """The waveform tolerance the README allows for the run's mel error."""
    references = indexed(golden, FLOW_CHUNK)[:len(run.calls) - 1] + [golden["flow_mel_nonstream"]]
    err = max(assert_close(call.mel, reference[:, :, ratio * call.offset:], MEL_ATOL, f"flow call {i}")
              for i, (call, reference) in enumerate(zip(run.calls, references, strict=True)))
    return E2E_ATOL if err <= E2E_MEL_ATOL else E2E_ATOL_LOOSE


@checks(f"{E2E_CHUNK}{INDEX}")
def test_e2e_streaming(streaming_run: Run, golden: dict[str, np.ndarray], flow: DiTFlowModel) -> None:
    atol = e2e_atol(streaming_run, golden, flow.config.token_mel_ratio)
    expected = indexed(golden, E2E_CHUNK)
    assert [chunk.shape for chunk in streaming_run.chunks] == [torch.Size(chunk.shape) for chunk in expected]
    for i, (audio, want) in enumerate(zip(streaming_run.chunks, expected)):
        assert_close(audio, want, atol, f"{E2E_CHUNK}{i}")


@checks("e2e_nonstream")
def test_e2e_offline(flow: DiTFlowModel, hift: CausalHiFTGenerator, prompt: Prompt,
                     golden: dict[str, np.ndarray]) -> None:
    run = synthesize(flow, hift, prompt, tensor(golden, "flow_token"), policy=None)
    (audio,) = run.chunks
    assert_close(audio, golden["e2e_nonstream"], e2e_atol(run, golden, flow.config.token_mel_ratio), "e2e_nonstream")


@checks(f"{E2E_CHUNK}{INDEX}", "e2e_nonstream")
def test_vocoder_stream_on_the_golden_mel(hift: CausalHiFTGenerator, golden: dict[str, np.ndarray],
                                          flow: DiTFlowModel) -> None:
    """The vocoder fed the golden mel of each chunk (the kept frames of the streaming chunks, then the offline
    mel's rest): the tighter waveform tolerance."""
    ends, offsets = golden["flow_stream_chunk_token_ends"], golden["flow_stream_chunk_token_offsets"]
    ratio = flow.config.token_mel_ratio
    mels = [*indexed(golden, FLOW_CHUNK), golden["flow_mel_nonstream"]]
    starts = [*offsets.tolist(), int(ends[-1]) - flow.config.pre_lookahead_len]
    stream = CausalVocoderStream(hift, noise=ZeroNoise())
    for i, (mel, start, expected) in enumerate(zip(mels, starts, indexed(golden, E2E_CHUNK), strict=True)):
        audio = stream.push(torch.from_numpy(mel[:, :, ratio * start:]), finalize=i == len(mels) - 1)
        assert_close(audio, expected, WAVE_ATOL, f"{E2E_CHUNK}{i} from the golden mel")
    offline = CausalVocoderStream(hift, noise=ZeroNoise()).push(tensor(golden, "flow_mel_nonstream"), finalize=True)
    assert_close(offline, golden["e2e_nonstream"], WAVE_ATOL, "e2e_nonstream from the golden mel")


# ---- ONNX stand-ins (how our code calls campplus.onnx and speech_tokenizer_v3.onnx) ------------------

@checks("onnx_campplus_out")
def test_onnx_campplus(golden: dict[str, np.ndarray], model_dir: Path) -> None:
    session = open_session(model_dir / "campplus.onnx", device="cpu")
    (name,) = input_names(session)
    out = session.run(None, {name: golden["onnx_campplus_in"]})[0]
    assert_close(out, golden["onnx_campplus_out"], CAMPPLUS_ATOL, "onnx_campplus_out")


@checks("onnx_tokenizer_out")
def test_onnx_speech_tokenizer(golden: dict[str, np.ndarray], model_dir: Path) -> None:
    session = open_session(model_dir / COSYVOICE3.speech_tokenizer_file, device="cpu")
    feats_name, length_name = input_names(session)
    feats = golden["onnx_tokenizer_in"]  # (1, 128, T), all T frames valid
    out = session.run(None, {feats_name: feats, length_name: np.array([feats.shape[2]], np.int32)})[0]
    assert out.dtype == golden["onnx_tokenizer_out"].dtype
    np.testing.assert_array_equal(out, golden["onnx_tokenizer_out"])
