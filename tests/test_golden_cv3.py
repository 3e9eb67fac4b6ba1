"""Our CosyVoice3 modules against every output of the official implementation in the CosyVoice3 golden folder.

The folder (`COSYVOICE_GOLDEN_CV3_DIR`, default tests/golden/cv3/tiny) holds a tiny CosyVoice3 checkpoint in
the released layout, the inputs, and what the official code computed from them; its README describes each
array and the tolerances used here. Dimensions come from the checkpoint, lengths and chunk counts from the
arrays, seeds and the thread count from golden.json, so the tests run unchanged on any folder with the same
keys (tests/test_golden_cv3_harness.py runs them on a folder of other dimensions and seeds).

Each test names the arrays it compares with `@checks(...)`; `golden_checks.INPUTS` names the arrays that only
feed the models. `test_every_golden_array_is_checked` fails when the folder holds an array that neither names.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.family import COSYVOICE3, family_of
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.messages import ChunkPolicy, FlowPrompt
from cosyvoice_triton.models.causal_hift import CausalHiFTGenerator
from cosyvoice_triton.models.dit_flow import DiTFlowModel
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.fixed_noise import cosyvoice3_draws, official_noise
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule
from cosyvoice_triton.token2wav.causal_vocoder_stream import CausalVocoderStream
from golden_checks import (F0_ATOL_HZ, FLOW_CHUNK, INDEX, LLM_OUTPUTS, MEL_ATOL, ONNX_OUTPUTS, RAND_NOISE_FILE,
                           WAVE_ATOL, Registry, assert_close, assert_json_describes_every_array,
                           assert_same_folded_weights, check_flow_keys_and_noise, check_llm_outputs,
                           check_onnx_standins, flow_prompt, indexed, run_flow, tensor)
from golden_checks import e2e_atol as golden_e2e_atol
from golden_checks import llm_prompt as golden_llm_prompt
from recorded_noise import RecordedNoise

REPO_ROOT = Path(__file__).resolve().parents[1]

# End to end (our flow feeding our HiFT): E2E_ATOL (1e-3) while our mel is within 1e-5 of the golden mel,
# else E2E_ATOL_LOOSE (5e-3) (the README: HiFT amplifies mel errors 4-40x).
E2E_MEL_ATOL = 1e-5
HIFT_CHUNK, E2E_CHUNK = "hift_stream_chunk", "e2e_stream_chunk"
registry = Registry()
checks = registry.checks


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
    registry.assert_every_array_is_checked(golden, golden_path)


def test_golden_json_describes_every_array(golden: dict[str, np.ndarray], golden_meta: dict) -> None:
    assert_json_describes_every_array(golden, golden_meta)


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
    return golden_llm_prompt(golden)


@pytest.fixture(scope="module")
def lm_input(llm: SpeechLM, llm_prompt) -> torch.Tensor:
    return llm.build_prompt(*llm_prompt)  # (1, L, D)


@checks(*LLM_OUTPUTS)
def test_llm_outputs(llm: SpeechLM, lm_input: torch.Tensor, golden: dict[str, np.ndarray]) -> None:
    """The prompt frame (sos and task id from speech_embedding), the length limits, one-shot and KV-cached
    logits and log-probs of the 200-id speech head."""
    check_llm_outputs(llm, lm_input, golden)


def test_lm_needs_end_of_prompt(llm: SpeechLM, llm_prompt) -> None:
    from cosyvoice_triton.errors import InvalidInput

    text, prompt_text, prompt_speech = llm_prompt
    marker = llm.config.layout.required_text_id
    with pytest.raises(InvalidInput, match="prompt_text_token"):
        llm.build_prompt(text, prompt_text[prompt_text != marker][None], prompt_speech)


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

@pytest.fixture(scope="module")
def flow(model_dir: Path) -> DiTFlowModel:
    return family_models(model_dir).load_flow(model_dir)


@pytest.fixture(scope="module")
def prompt(golden: dict[str, np.ndarray]) -> FlowPrompt:
    return flow_prompt(golden)


@checks(RAND_NOISE_FILE, "flow_rand_noise_first")
def test_flow_keys_and_fixed_noise(flow: DiTFlowModel, golden: dict[str, np.ndarray], golden_path: Path,
                                   model_dir: Path) -> None:
    check_flow_keys_and_noise(flow, model_dir / "flow.pt", golden, golden_path)


@checks("flow_mel_nonstream")
def test_flow_offline(flow: DiTFlowModel, prompt: FlowPrompt, golden: dict[str, np.ndarray]) -> None:
    mel = run_flow(flow, prompt, golden["flow_token"], streaming=False, finalize=True)
    assert_close(mel, golden["flow_mel_nonstream"], MEL_ATOL, "flow_mel_nonstream")


@checks(f"{FLOW_CHUNK}{INDEX}", "flow_stream_chunk_token_ends")
def test_flow_streaming_chunks(flow: DiTFlowModel, prompt: FlowPrompt, golden: dict[str, np.ndarray]) -> None:
    """Chunk attention, and finalize=False: the last pre_lookahead_len tokens make no frames."""
    ends = golden["flow_stream_chunk_token_ends"].tolist()
    for i, (end, expected) in enumerate(zip(ends, indexed(golden, FLOW_CHUNK), strict=True)):
        mel = run_flow(flow, prompt, golden["flow_token"][:, :end], streaming=True, finalize=False)
        assert mel.shape[-1] == flow.config.token_mel_ratio * (prompt.speech_tokens.shape[1] + end
                                                               - flow.config.pre_lookahead_len) - prompt.mel.shape[1]
        assert_close(mel, expected, MEL_ATOL, f"{FLOW_CHUNK}{i}")


def test_flow_rows_of_a_batch_equal_their_solo_runs(flow: DiTFlowModel, prompt: FlowPrompt,
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
    assert_same_folded_weights(hift, legacy)


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


def synthesize(flow: DiTFlowModel, hift: CausalHiFTGenerator, prompt: FlowPrompt, tokens: torch.Tensor,
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
def streaming_run(flow: DiTFlowModel, hift: CausalHiFTGenerator, prompt: FlowPrompt, golden: dict[str, np.ndarray]) -> Run:
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
    return golden_e2e_atol(run.calls, golden, ratio, E2E_MEL_ATOL)


@checks(f"{E2E_CHUNK}{INDEX}")
def test_e2e_streaming(streaming_run: Run, golden: dict[str, np.ndarray], flow: DiTFlowModel) -> None:
    atol = e2e_atol(streaming_run, golden, flow.config.token_mel_ratio)
    expected = indexed(golden, E2E_CHUNK)
    assert [chunk.shape for chunk in streaming_run.chunks] == [torch.Size(chunk.shape) for chunk in expected]
    for i, (audio, want) in enumerate(zip(streaming_run.chunks, expected)):
        assert_close(audio, want, atol, f"{E2E_CHUNK}{i}")


@checks("e2e_nonstream")
def test_e2e_offline(flow: DiTFlowModel, hift: CausalHiFTGenerator, prompt: FlowPrompt,
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

@checks(*ONNX_OUTPUTS)
def test_onnx_standins(golden: dict[str, np.ndarray], model_dir: Path) -> None:
    check_onnx_standins(golden, model_dir / "campplus.onnx", model_dir / COSYVOICE3.speech_tokenizer_file)
