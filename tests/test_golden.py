"""Our modules against every output of the official implementation in the golden folder.

The folder (`COSYVOICE_GOLDEN_DIR`, default ../shared/golden/tiny) holds a tiny CosyVoice2 checkpoint,
the inputs, and what the official code computed from them; its README describes each array and the
tolerances used here. Dimensions come from the checkpoint, lengths and chunk counts from the arrays and
seeds from golden.json, so the tests run unchanged on any folder with the same keys.

Each test names the arrays it compares with `@checks(...)`; `INPUTS` names the arrays that only feed
the models. `test_every_golden_array_is_checked` fails when the folder holds an array that neither names.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.config import read_yaml
from cosyvoice_triton.engines.onnx_session import input_names, open_session
from cosyvoice_triton.models.flow import FlowConfig, FlowMatching, FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import GeneratorNoise, ZeroNoise
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.messages import ChunkPolicy
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.token2wav.stream import FlowPrompt, Token2Wav
from cosyvoice_triton.token2wav.vocoder_stream import VocoderStream
from recorded_noise import RecordedNoise
from test_llm_sampling import greedy_sampler

# The README's tolerances for a faithful fp32 implementation (max abs error).
LOGIT_ATOL = 1e-4  # LLM logits and log-probs
MEL_ATOL = 1e-4  # flow mel, offline and streaming chunks
WAVE_ATOL = 1e-3  # HiFT waveforms computed from the golden mel
F0_ATOL_HZ = 1e-3
CAMPPLUS_ATOL = 1e-5  # the speech-tokenizer stand-in must match exactly
# End to end (our flow feeding our HiFT), HiFT amplifies mel errors ~30x: 1e-3 holds while our mel is
# within 3e-5 of the golden mel, 5e-3 while it is within MEL_ATOL.
E2E_ATOL, E2E_ATOL_LOOSE, E2E_MEL_ATOL = 1e-3, 5e-3, 3e-5

INDEX = "{i}"  # in a registered name: the chunk index 0, 1, ... (a family of arrays)
FLOW_CHUNK, E2E_CHUNK = "flow_mel_stream_chunk", "e2e_stream_chunk"
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


# ---- helpers --------------------------------------------------------------------------------------

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


# ---- the folder -----------------------------------------------------------------------------------

def test_every_golden_array_is_checked(golden: dict[str, np.ndarray], golden_path: Path) -> None:
    arrays = set(golden) | {path.name for path in golden_path.glob("*.npy")}
    patterns = {name: name_pattern(name) for name in INPUTS | set(CHECKED)}
    unclaimed = sorted(key for key in arrays if not any(p.fullmatch(key) for p in patterns.values()))
    assert not unclaimed, f"golden arrays that no test checks: {unclaimed}"
    absent = sorted(name for name, p in patterns.items() if not any(p.fullmatch(key) for key in arrays))
    assert not absent, f"named here but not in {golden_path}: {absent}"


def test_chunk_families_are_ordered_by_number() -> None:
    arrays = {f"{E2E_CHUNK}{i}": np.full(1, i) for i in (10, 2, 0, 1, 9, 3, 4, 5, 6, 7, 8)}
    assert [int(a[0]) for a in indexed(arrays, E2E_CHUNK)] == list(range(11))


def test_golden_json_describes_every_array(golden: dict[str, np.ndarray], golden_meta: dict) -> None:
    described = golden_meta["keys"]
    assert set(described) == set(golden)
    for key, array in golden.items():
        assert list(array.shape) == described[key]["shape"], key
        assert array.dtype == np.dtype(described[key]["dtype"]), key


# ---- speech LM --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(golden_model_dir: Path, golden: dict[str, np.ndarray]) -> SpeechLM:
    decoded = max(golden["llm_forced_speech_token"].shape[1], golden["llm_greedy_tokens"].shape[0])
    return SpeechLM.from_model_dir(golden_model_dir, max_batch=2,
                                   max_seq_len=golden["llm_lm_input"].shape[1] + decoded + 1)


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


@checks("llm_greedy_tokens")
def test_greedy_tokens(llm: SpeechLM, llm_prompt, golden: dict[str, np.ndarray]) -> None:
    expected = golden["llm_greedy_tokens"].tolist()
    assert list(islice(generate(llm, *llm_prompt, sampler=greedy_sampler), len(expected))) == expected


# ---- flow -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flow_config(golden_model_dir: Path) -> FlowConfig:
    return FlowConfig.from_yaml(read_yaml(golden_model_dir / "cosyvoice2.yaml"))


@pytest.fixture(scope="module")
def flow(golden_model_dir: Path) -> FlowModel:
    return FlowModel.from_model_dir(golden_model_dir)


@pytest.fixture(scope="module")
def flow_prompt(golden: dict[str, np.ndarray]) -> FlowPrompt:
    return FlowPrompt(speech_tokens=tensor(golden, "in_prompt_speech_token"), mel=tensor(golden, "in_prompt_feat"),
                      embedding=tensor(golden, "in_embedding"))


def run_flow(flow: FlowModel, prompt: FlowPrompt, tokens: np.ndarray, streaming: bool, finalize: bool) -> torch.Tensor:
    """The README's flow call on `tokens` (1, N): mel (1, 80, frames) without the prompt frames."""
    def length(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([x.shape[1]], dtype=torch.int32)

    token = torch.from_numpy(tokens)
    return flow.inference(token, length(token), prompt.speech_tokens, length(prompt.speech_tokens), prompt.mel,
                          length(prompt.mel), prompt.embedding, streaming=streaming, finalize=finalize)


def test_flow_state_dict_matches_checkpoint(flow: FlowModel, golden_model_dir: Path) -> None:
    released = torch.load(golden_model_dir / "flow.pt", weights_only=True, map_location="cpu")
    assert set(flow.state_dict()) == set(released)


@checks(RAND_NOISE_FILE, "flow_rand_noise_first")
def test_fixed_noise(flow: FlowModel, golden: dict[str, np.ndarray], golden_path: Path) -> None:
    noise = flow.decoder.rand_noise.numpy()
    np.testing.assert_array_equal(noise, np.load(golden_path / RAND_NOISE_FILE))
    first = golden["flow_rand_noise_first"]
    np.testing.assert_array_equal(noise[..., :first.shape[-1]], first)


def test_fixed_noise_does_not_reseed_global_rng(flow_config: FlowConfig) -> None:
    torch.manual_seed(1234)
    FlowMatching(flow_config)
    assert torch.initial_seed() == 1234


@checks("flow_mel_nonstream")
def test_flow_offline(flow: FlowModel, flow_prompt: FlowPrompt, golden: dict[str, np.ndarray]) -> None:
    mel = run_flow(flow, flow_prompt, golden["flow_token"], streaming=False, finalize=True)
    assert_close(mel, golden["flow_mel_nonstream"], MEL_ATOL, "flow_mel_nonstream")


@checks(f"{FLOW_CHUNK}{INDEX}", "flow_stream_chunk_token_ends")
def test_flow_streaming_chunks(flow: FlowModel, flow_prompt: FlowPrompt, golden: dict[str, np.ndarray]) -> None:
    ends = golden["flow_stream_chunk_token_ends"].tolist()
    for i, (end, expected) in enumerate(zip(ends, indexed(golden, FLOW_CHUNK), strict=True)):
        mel = run_flow(flow, flow_prompt, golden["flow_token"][:, :end], streaming=True, finalize=False)
        assert_close(mel, expected, MEL_ATOL, f"{FLOW_CHUNK}{i}")


def test_flow_output_lengths(flow: FlowModel, golden: dict[str, np.ndarray]) -> None:
    n_prompt = torch.tensor([golden["in_prompt_speech_token"].shape[1]])
    n_prompt_frames = torch.tensor([golden["in_prompt_feat"].shape[1]])
    ends = golden["flow_stream_chunk_token_ends"].tolist()
    for end, chunk in zip(ends, indexed(golden, FLOW_CHUNK), strict=True):
        frames = flow.output_lengths(torch.tensor([end]), n_prompt, n_prompt_frames, finalize=False)
        assert frames.tolist() == [chunk.shape[-1]]
    frames = flow.output_lengths(torch.tensor([golden["flow_token"].shape[1]]), n_prompt, n_prompt_frames,
                                 finalize=True)
    assert frames.tolist() == [golden["flow_mel_nonstream"].shape[-1]]


# ---- HiFT -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hift(golden_model_dir: Path) -> HiFTGenerator:
    return HiFTGenerator.from_model_dir(golden_model_dir)


@pytest.fixture(scope="module")
def hift_mel(golden: dict[str, np.ndarray]) -> torch.Tensor:
    return tensor(golden, "hift_in_mel")  # (1, 80, T)


def recorded_noise(golden: dict[str, np.ndarray]) -> RecordedNoise:
    return RecordedNoise(*(tensor(golden, f"hift_seeded_{draw}") for draw in ("rand_ini", "sine_noise", "source_noise")))


def test_hift_weight_norm_namings_load_identically(hift: HiFTGenerator, golden_model_dir: Path) -> None:
    legacy = HiFTGenerator(hift.config)
    legacy.load_hift_state(golden_model_dir / "extras" / "hift_legacy_weight_norm.pt")
    current, other = hift.state_dict(), legacy.state_dict()
    assert current.keys() == other.keys()
    for key in current:
        assert torch.equal(current[key], other[key]), key
    assert "conv_pre.weight" in current and not any("weight_g" in k or "parametrizations" in k for k in current)


def test_hift_config_matches_the_arrays(hift: HiFTGenerator, golden: dict[str, np.ndarray], golden_meta: dict) -> None:
    config = hift.config
    assert config.sampling_rate == golden_meta["sample_rate"]
    assert config.samples_per_frame * golden["hift_in_mel"].shape[-1] == golden["hift_seeded_speech"].shape[-1]
    harmonics = golden["hift_seeded_rand_ini"].shape[-1]  # the fundamental and its overtones
    assert config.nb_harmonics + 1 == hift.m_source.l_linear.in_features == harmonics


@checks("hift_f0")
def test_hift_f0(hift: HiFTGenerator, hift_mel: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    with torch.inference_mode():
        f0 = hift.f0_predictor(hift_mel)
    assert_close(f0, golden["hift_f0"], F0_ATOL_HZ, "hift_f0")


@checks("hift_zeronoise_speech", "hift_zeronoise_source")
def test_hift_zero_noise(hift: HiFTGenerator, hift_mel: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    speech, source = hift.inference(hift_mel, None, ZeroNoise())
    assert_close(speech, golden["hift_zeronoise_speech"], WAVE_ATOL, "hift_zeronoise_speech")
    assert_close(source, golden["hift_zeronoise_source"], WAVE_ATOL, "hift_zeronoise_source")


@checks("hift_seeded_speech", "hift_seeded_source")
def test_hift_recorded_noise(hift: HiFTGenerator, hift_mel: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    speech, source = hift.inference(hift_mel, None, recorded_noise(golden))
    assert_close(speech, golden["hift_seeded_speech"], WAVE_ATOL, "hift_seeded_speech")
    assert_close(source, golden["hift_seeded_source"], WAVE_ATOL, "hift_seeded_source")


@checks("hift_seeded_rand_ini", "hift_seeded_sine_noise", "hift_seeded_source_noise",
        "hift_seeded_speech", "hift_seeded_source")
def test_hift_seeded_generator_follows_official_global_rng(hift: HiFTGenerator, hift_mel: torch.Tensor,
                                                           golden: dict[str, np.ndarray], golden_meta: dict) -> None:
    """Our seeded noise makes the official code's three draws after `torch.manual_seed(hift_seed)`."""
    seed, cpu = golden_meta["hift_seed"], torch.device("cpu")
    noise = GeneratorNoise.seeded(seed)
    (_, length, harmonics) = golden["hift_seeded_sine_noise"].shape
    draws = {"rand_ini": noise.initial_phase(1, harmonics, cpu),
             "sine_noise": noise.sine_noise((1, length, harmonics), cpu),
             "source_noise": noise.source_noise((1, length, 1), cpu)}
    for name, draw in draws.items():
        np.testing.assert_array_equal(draw.numpy(), golden[f"hift_seeded_{name}"], err_msg=name)
    speech, source = hift.inference(hift_mel, None, GeneratorNoise.seeded(seed))
    assert_close(speech, golden["hift_seeded_speech"], WAVE_ATOL, "hift_seeded_speech (generator)")
    assert_close(source, golden["hift_seeded_source"], WAVE_ATOL, "hift_seeded_source (generator)")


# ---- end to end: the streaming and offline token2wav paths ------------------------------------------

@dataclass
class FlowCall:
    """One flow call made by a Token2WavStream."""

    n_tokens: int  # tokens given to the flow (all so far)
    offset: int  # the mel is kept from token_mel_ratio * offset on
    finalize: bool
    streaming: bool
    mel: torch.Tensor  # (1, 80, frames) the kept frames


class RecordingToken2Wav(Token2Wav):
    """Token2Wav that keeps every flow call its streams make."""

    def __init__(self, flow: FlowModel, hift: HiFTGenerator):
        super().__init__(flow, hift)
        self.calls: list[FlowCall] = []

    def mel(self, tokens: torch.Tensor, prompt: FlowPrompt, token_offset: int, finalize: bool,
            streaming: bool, **cache_args) -> torch.Tensor:
        mel = super().mel(tokens, prompt, token_offset, finalize=finalize, streaming=streaming, **cache_args)
        self.calls.append(FlowCall(tokens.shape[1], token_offset, finalize, streaming, mel))
        return mel


@dataclass
class Run:
    chunks: list[np.ndarray]  # audio chunks (N,)
    calls: list[FlowCall]


def synthesize(flow: FlowModel, hift: HiFTGenerator, prompt: FlowPrompt, tokens: list[int],
               policy: ChunkPolicy | None) -> Run:
    """Token2Wav on `tokens` arriving one by one, as the LLM yields them, with HiFT noise zeroed (as the
    golden set was made). With a policy, chunks are cut by its schedule; without, one offline chunk."""
    engine = RecordingToken2Wav(flow, hift)
    stream = engine.stream(prompt, ZeroNoise(), lookahead=policy.lookahead if policy else None)
    chunks, sent = [], 0
    if policy is not None:
        schedule = ChunkSchedule(policy, prompt.speech_tokens.shape[1])
        for count in range(1, len(tokens) + 1):
            while count >= schedule.needed:
                _, end = schedule.advance()
                chunks.append(stream.chunk(tokens[sent:end], finalize=False))
                sent = end
    chunks.append(stream.chunk(tokens[sent:], finalize=True))
    return Run(chunks, engine.calls)


@pytest.fixture(scope="module")
def streaming_run(flow: FlowModel, hift: HiFTGenerator, flow_prompt: FlowPrompt, golden: dict[str, np.ndarray]) -> Run:
    """The official `tts(stream=True)` schedule: token_hop_len 25 at first, the flow's lookahead."""
    policy = ChunkPolicy(lookahead=flow.config.pre_lookahead_len)
    return synthesize(flow, hift, flow_prompt, golden["flow_token"][0].tolist(), policy)


@pytest.fixture(scope="module")
def offline_run(flow: FlowModel, hift: HiFTGenerator, flow_prompt: FlowPrompt, golden: dict[str, np.ndarray]) -> Run:
    return synthesize(flow, hift, flow_prompt, golden["flow_token"][0].tolist(), policy=None)


def e2e_atol(run: Run, golden: dict[str, np.ndarray], ratio: int) -> float:
    """The waveform tolerance the README allows for the run's mel error (call i against streaming chunk i,
    the final call against the offline mel)."""
    references = indexed(golden, FLOW_CHUNK)[:len(run.calls) - 1] + [golden["flow_mel_nonstream"]]
    err = max(assert_close(call.mel, reference[:, :, ratio * call.offset:], MEL_ATOL, f"flow call {i}")
              for i, (call, reference) in enumerate(zip(run.calls, references, strict=True)))
    return E2E_ATOL if err <= E2E_MEL_ATOL else E2E_ATOL_LOOSE


@checks("flow_stream_chunk_token_ends", "flow_stream_chunk_token_offsets", f"{FLOW_CHUNK}{INDEX}")
def test_streaming_flow_calls_follow_the_official_schedule(streaming_run: Run, golden: dict[str, np.ndarray],
                                                           flow_config: FlowConfig) -> None:
    """Non-final call i sees the first `ends[i]` tokens with chunk attention and keeps its mel from
    `offsets[i]` on (what `token2wav` keeps of `flow_mel_stream_chunk{i}`)."""
    ends, offsets = golden["flow_stream_chunk_token_ends"].tolist(), golden["flow_stream_chunk_token_offsets"].tolist()
    *partial, _ = streaming_run.calls
    assert [(call.n_tokens, call.offset) for call in partial] == list(zip(ends, offsets, strict=True))
    assert all(call.streaming and not call.finalize for call in partial)
    for i, (call, mel) in enumerate(zip(partial, indexed(golden, FLOW_CHUNK), strict=True)):
        assert_close(call.mel, mel[:, :, flow_config.token_mel_ratio * call.offset:], MEL_ATOL, f"streaming call {i}")


@checks("flow_mel_nonstream")
def test_final_streaming_call_equals_nonstream(streaming_run: Run, golden: dict[str, np.ndarray],
                                               flow_config: FlowConfig) -> None:
    """README: the final call starts where the last streaming chunk stopped (its end minus the lookahead
    tokens, which made no frames), uses finalize=True with full attention, and equals
    `flow_mel_nonstream` from there on."""
    final = streaming_run.calls[-1]
    offset = int(golden["flow_stream_chunk_token_ends"][-1]) - flow_config.pre_lookahead_len
    assert (final.n_tokens, final.offset) == (golden["flow_token"].shape[1], offset)
    assert final.finalize and not final.streaming
    expected = golden["flow_mel_nonstream"][:, :, flow_config.token_mel_ratio * offset:]
    assert_close(final.mel, expected, MEL_ATOL, "final streaming call")


@checks(f"{E2E_CHUNK}{INDEX}")
def test_e2e_streaming(streaming_run: Run, golden: dict[str, np.ndarray], flow_config: FlowConfig) -> None:
    atol = e2e_atol(streaming_run, golden, flow_config.token_mel_ratio)
    expected = [chunk[0] for chunk in indexed(golden, E2E_CHUNK)]
    assert [chunk.shape for chunk in streaming_run.chunks] == [chunk.shape for chunk in expected]
    for i, (audio, want) in enumerate(zip(streaming_run.chunks, expected)):
        assert_close(audio, want, atol, f"{E2E_CHUNK}{i}")


@checks("e2e_nonstream")
def test_e2e_offline(offline_run: Run, golden: dict[str, np.ndarray], flow_config: FlowConfig) -> None:
    atol = e2e_atol(offline_run, golden, flow_config.token_mel_ratio)
    (audio,) = offline_run.chunks
    assert_close(audio, golden["e2e_nonstream"][0], atol, "e2e_nonstream")


def test_streaming_and_offline_audio_have_the_same_length(streaming_run: Run, offline_run: Run) -> None:
    assert sum(chunk.size for chunk in streaming_run.chunks) == offline_run.chunks[0].size


def golden_mel_chunks(golden: dict[str, np.ndarray], config: FlowConfig) -> list[tuple[torch.Tensor, bool]]:
    """The new mel frames of each official streaming chunk, taken from the golden mels, and whether it is
    the final one: chunk i keeps `flow_mel_stream_chunk{i}` from `offsets[i]` on, and the final chunk the
    offline mel from the last streaming end minus the lookahead."""
    ends, offsets = golden["flow_stream_chunk_token_ends"], golden["flow_stream_chunk_token_offsets"]
    mels = [*indexed(golden, FLOW_CHUNK), golden["flow_mel_nonstream"]]
    offsets = [*offsets.tolist(), int(ends[-1]) - config.pre_lookahead_len]
    return [(torch.from_numpy(mel[:, :, config.token_mel_ratio * offset:]), i == len(mels) - 1)
            for i, (mel, offset) in enumerate(zip(mels, offsets, strict=True))]


@checks(f"{E2E_CHUNK}{INDEX}", "e2e_nonstream")
def test_vocoder_stream_on_the_golden_mel(hift: HiFTGenerator, golden: dict[str, np.ndarray],
                                          flow_config: FlowConfig) -> None:
    """HiFT with the official caches and cross-fade, fed the golden mel: the tighter waveform tolerance."""
    stream = VocoderStream(hift, noise=ZeroNoise())
    outputs = [stream.push(mel, finalize) for mel, finalize in golden_mel_chunks(golden, flow_config)]
    for i, (audio, expected) in enumerate(zip(outputs, indexed(golden, E2E_CHUNK), strict=True)):
        assert_close(audio, expected, WAVE_ATOL, f"{E2E_CHUNK}{i} from the golden mel")
    assert stream.closed and stream.cached_mel is None and stream.cached_source is None
    offline = VocoderStream(hift, noise=ZeroNoise()).push(tensor(golden, "flow_mel_nonstream"), finalize=True)
    assert_close(offline, golden["e2e_nonstream"], WAVE_ATOL, "e2e_nonstream from the golden mel")


# ---- ONNX stand-ins (how our code calls campplus.onnx and speech_tokenizer_v2.onnx) ------------------

@checks("onnx_campplus_out")
def test_onnx_campplus(golden: dict[str, np.ndarray], golden_model_dir: Path) -> None:
    session = open_session(golden_model_dir / "campplus.onnx", device="cpu")
    (name,) = input_names(session)
    out = session.run(None, {name: golden["onnx_campplus_in"]})[0]
    assert_close(out, golden["onnx_campplus_out"], CAMPPLUS_ATOL, "onnx_campplus_out")


@checks("onnx_tokenizer_out")
def test_onnx_speech_tokenizer(golden: dict[str, np.ndarray], golden_model_dir: Path) -> None:
    session = open_session(golden_model_dir / "speech_tokenizer_v2.onnx", device="cpu")
    feats_name, length_name = input_names(session)
    feats = golden["onnx_tokenizer_in"]  # (1, 128, T), all T frames valid
    out = session.run(None, {feats_name: feats, length_name: np.array([feats.shape[2]], np.int32)})[0]
    assert out.dtype == golden["onnx_tokenizer_out"].dtype
    np.testing.assert_array_equal(out, golden["onnx_tokenizer_out"])
