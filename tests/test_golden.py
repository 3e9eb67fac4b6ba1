"""Our modules against every output of the official implementation in the golden folder.

The folder (`COSYVOICE_GOLDEN_DIR`, default ../shared/golden/tiny) holds a tiny CosyVoice2 checkpoint,
the inputs, and what the official code computed from them; its README describes each array and the
tolerances used here. Dimensions come from the checkpoint, lengths and chunk counts from the arrays and
seeds from golden.json, so the tests run unchanged on any folder with the same keys.

Each test names the arrays it compares with `@checks(...)`; `golden_checks.INPUTS` names the arrays that
only feed the models. `test_every_golden_array_is_checked` fails when the folder holds an array that neither
names.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.config import read_yaml
from cosyvoice_triton.models.flow import FlowConfig, FlowMatching, FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import GeneratorNoise, ZeroNoise
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.messages import ChunkPolicy
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.token2wav.stream import FlowPrompt, Token2Wav
from cosyvoice_triton.token2wav.vocoder_stream import VocoderStream
from golden_checks import (F0_ATOL_HZ, FLOW_CHUNK, INDEX, LLM_OUTPUTS, MEL_ATOL, ONNX_OUTPUTS, RAND_NOISE_FILE,
                           WAVE_ATOL, Registry, assert_close, assert_json_describes_every_array,
                           assert_same_folded_weights, check_flow_keys_and_noise, check_llm_outputs,
                           check_onnx_standins, indexed, run_flow, tensor)
from golden_checks import e2e_atol as golden_e2e_atol
from golden_checks import flow_prompt as golden_flow_prompt
from golden_checks import llm_prompt as golden_llm_prompt
from recorded_noise import RecordedNoise
from test_llm_sampling import greedy_sampler

# End to end (our flow feeding our HiFT), HiFT amplifies mel errors ~30x: E2E_ATOL (1e-3) holds while our mel
# is within 3e-5 of the golden mel, E2E_ATOL_LOOSE (5e-3) while it is within MEL_ATOL.
E2E_MEL_ATOL = 3e-5
E2E_CHUNK = "e2e_stream_chunk"
registry = Registry()
checks = registry.checks


# ---- the folder -----------------------------------------------------------------------------------

def test_every_golden_array_is_checked(golden: dict[str, np.ndarray], golden_path: Path) -> None:
    registry.assert_every_array_is_checked(golden, golden_path)


def test_chunk_families_are_ordered_by_number() -> None:
    arrays = {f"{E2E_CHUNK}{i}": np.full(1, i) for i in (10, 2, 0, 1, 9, 3, 4, 5, 6, 7, 8)}
    assert [int(a[0]) for a in indexed(arrays, E2E_CHUNK)] == list(range(11))


def test_golden_json_describes_every_array(golden: dict[str, np.ndarray], golden_meta: dict) -> None:
    assert_json_describes_every_array(golden, golden_meta)


# ---- speech LM --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(golden_model_dir: Path, golden: dict[str, np.ndarray]) -> SpeechLM:
    decoded = max(golden["llm_forced_speech_token"].shape[1], golden["llm_greedy_tokens"].shape[0])
    return SpeechLM.from_model_dir(golden_model_dir, max_batch=2,
                                   max_seq_len=golden["llm_lm_input"].shape[1] + decoded + 1)


@pytest.fixture(scope="module")
def llm_prompt(golden: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return golden_llm_prompt(golden)


@pytest.fixture(scope="module")
def lm_input(llm: SpeechLM, llm_prompt) -> torch.Tensor:
    return llm.build_prompt(*llm_prompt)  # (1, L, D)


@checks(*LLM_OUTPUTS)
def test_llm_outputs(llm: SpeechLM, lm_input: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    """The prompt frame, the length limits, one-shot and KV-cached logits (prefill, then one cached step per
    forced token, as the official inference loop does) and log-probs."""
    check_llm_outputs(llm, lm_input, golden)


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
    return golden_flow_prompt(golden)


@checks(RAND_NOISE_FILE, "flow_rand_noise_first")
def test_flow_keys_and_fixed_noise(flow: FlowModel, golden: dict[str, np.ndarray], golden_path: Path,
                                   golden_model_dir: Path) -> None:
    check_flow_keys_and_noise(flow, golden_model_dir / "flow.pt", golden, golden_path)


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
    assert_same_folded_weights(hift, legacy)


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
    return golden_e2e_atol(run.calls, golden, ratio, E2E_MEL_ATOL)


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

@checks(*ONNX_OUTPUTS)
def test_onnx_standins(golden: dict[str, np.ndarray], golden_model_dir: Path) -> None:
    check_onnx_standins(golden, golden_model_dir / "campplus.onnx", golden_model_dir / "speech_tokenizer_v2.onnx")
