"""A set in the CosyVoice3 golden format, made by this project's own modules on a random folder of any size.

It checks the golden test itself, not fidelity (the outputs are ours): `test_golden_cv3.py` run on such a set,
with other dimensions, lengths, seeds and thread count than the official set, must pass unchanged, which it
can only if it takes them from the checkpoint, the arrays and golden.json (tests/test_golden_cv3_harness.py).
Inputs are drawn as the official set's are (the README's order); every output key is made the way the
README says the official one was.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from cosyvoice_triton.family import COSYVOICE3, END_OF_PROMPT_ID
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.fixed_noise import cosyvoice3_draws, official_noise
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule
from cosyvoice_triton.random_folder.cosyvoice3_yaml import CosyVoice3Size
from cosyvoice_triton.random_folder.write import write_random_model
from cosyvoice_triton.token2wav.causal_vocoder_stream import CausalVocoderStream
from golden_checks import flow_prompt, run_flow, stepwise_logits
from test_golden_cv3 import official_policy, synthesize

GREEDY_CAP = 40  # tokens of the greedy decode at most (the official set's cap)
FIRST_F0_FRAMES = 8  # `flow_rand_noise_first`


@dataclass(frozen=True)
class Lengths:
    text: int = 9
    prompt_text: int = 5  # <|endofprompt|> at index 2
    prompt_speech: int = 15
    forced: int = 17
    flow: int = 100
    campplus_frames: int = 150
    tokenizer_frames: int = 317


def make_golden_set(out: Path, size: CosyVoice3Size, model_seed: int, seed_inputs: int, hift_seed: int,
                    threads: int, lengths: Lengths = Lengths()) -> Path:
    model_dir = write_random_model(out / "model", size=size, seed=model_seed, family=COSYVOICE3,
                                   backbone_weights=False)
    _write_other_weight_norm_naming(model_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        arrays, flow_noise = _arrays(model_dir, np.random.RandomState(seed_inputs), lengths)
    finally:
        torch.set_num_threads(before)
    np.savez(out / "golden.npz", **arrays)
    np.save(out / "flow_rand_noise.npy", flow_noise)
    keys = {key: {"shape": list(array.shape), "dtype": str(array.dtype)} for key, array in arrays.items()}
    meta = {"model_dir": "model", "threads": threads, "sample_rate": 24000, "seed_inputs": seed_inputs,
            "hift_seed": hift_seed, "keys": keys}
    (out / "golden.json").write_text(json.dumps(meta, indent=1))
    return out


def _write_other_weight_norm_naming(model_dir: Path) -> None:
    """extras/hift_legacy_weight_norm.pt: hift.pt's tensors under the other naming (the writer uses the legacy
    one, so this file has the parametrization one)."""
    state = torch.load(model_dir / "hift.pt", weights_only=True)
    renamed = {key.replace(".weight_g", ".parametrizations.weight.original0")
               .replace(".weight_v", ".parametrizations.weight.original1"): value for key, value in state.items()}
    (model_dir / "extras").mkdir()
    torch.save(renamed, model_dir / "extras" / "hift_legacy_weight_norm.pt")


def _arrays(model_dir: Path, rs: np.random.RandomState, n: Lengths) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every key of golden.npz, and the flow's whole fixed noise."""
    models = family_models(model_dir)
    a: dict[str, np.ndarray] = {}
    a["in_text_token"] = rs.randint(0, 151643, (1, n.text)).astype(np.int32)
    prompt_text = rs.randint(0, 151643, (1, n.prompt_text)).astype(np.int32)
    prompt_text[0, 2] = END_OF_PROMPT_ID
    a["in_prompt_text_token"] = prompt_text
    a["in_prompt_speech_token"] = rs.randint(0, 6561, (1, n.prompt_speech)).astype(np.int32)
    a["in_prompt_feat"] = (rs.randn(1, 2 * n.prompt_speech, 80) * 1.5 - 6).astype(np.float32)
    a["in_embedding"] = rs.randn(1, 192).astype(np.float32)
    a["llm_forced_speech_token"] = rs.randint(0, 6561, (1, n.forced)).astype(np.int64)
    a["flow_token"] = rs.randint(0, 6561, (1, n.flow)).astype(np.int32)
    a.update(_llm_arrays(models.load_llm(model_dir, max_batch=2, max_seq_len=256), a))
    flow, hift = models.load_flow(model_dir), models.load_vocoder(model_dir)
    a.update(_flow_and_vocoder_arrays(flow, hift, a))
    a.update(_onnx_arrays(model_dir, rs, n))
    return a, flow.decoder.rand_noise.numpy()


def _llm_arrays(llm, a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    prompt = [torch.from_numpy(a[k]) for k in ("in_text_token", "in_prompt_text_token", "in_prompt_speech_token")]
    lm_input = llm.build_prompt(*prompt)
    forced = torch.from_numpy(a["llm_forced_speech_token"])
    oneshot = llm.logits_full(torch.cat([lm_input, llm.embed_speech(forced)], dim=1))
    stepwise = stepwise_logits(llm, lm_input, forced)
    sampled: list[int] = []

    def greedy(logp: torch.Tensor, decoded, generator) -> int:
        sampled.append(int(logp.argmax()))
        return sampled[-1]

    tokens = list(islice(generate(llm, *prompt, sampler=greedy), GREEDY_CAP))
    stop = sampled[-1] if len(tokens) < GREEDY_CAP else -1
    min_len, max_len = llm.length_limits(a["in_text_token"].shape[1])
    return {"llm_lm_input": lm_input.numpy(), "llm_min_len": np.int64(min_len), "llm_max_len": np.int64(max_len),
            "llm_logits_oneshot": oneshot.numpy(), "llm_logits_stepwise": stepwise.numpy(),
            "llm_logp_stepwise": stepwise.log_softmax(dim=-1).numpy(),
            "llm_greedy_tokens": np.array(tokens, np.int64), "llm_greedy_stop": np.int64(stop)}


def _flow_and_vocoder_arrays(flow, hift, a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    prompt = flow_prompt(a)
    tokens = torch.from_numpy(a["flow_token"])
    offline = run_flow(flow, prompt, tokens, streaming=False, finalize=True)
    schedule, ends, offsets = ChunkSchedule(official_policy(flow), prompt.speech_tokens.shape[1]), [], []
    while schedule.needed <= tokens.shape[1]:
        start, end = schedule.advance()
        out[f"flow_mel_stream_chunk{len(ends)}"] = run_flow(flow, prompt, tokens[:, :end], True, False).numpy()
        ends.append(end)
        offsets.append(start)
    out.update(flow_mel_nonstream=offline.numpy(), flow_stream_chunk_token_ends=np.array(ends, np.int64),
               flow_stream_chunk_token_offsets=np.array(offsets, np.int64),
               flow_rand_noise_first=flow.decoder.rand_noise[:, :, :FIRST_F0_FRAMES].numpy(),
               hift_in_mel=offline.numpy())
    with torch.inference_mode():
        out["hift_f0"] = hift.f0_predictor(offline.double()).float().numpy()
    for name, noise in (("hift", None), ("hift_zeronoise", ZeroNoise())):
        speech, source = hift.inference(offline, finalize=True, noise=noise)
        out[f"{name}_speech"], out[f"{name}_source"] = speech.numpy(), source.numpy()
    f, h = flow.config, hift.config
    draws = cosyvoice3_draws(f.mel_bins, f.noise_frames, f.vocab_size, f.input_size, f.spk_embed_dim,
                             h.f0_in_channels, h.f0_cond_channels, h.f0_num_class)
    noise = official_noise(draws, out["hift_speech"].shape[-1])
    out.update(zip(("hift_fixed_rand_ini", "hift_fixed_sine_noise", "hift_fixed_source_noise"), (t.numpy() for t in noise)))
    ratio, lookahead = f.token_mel_ratio, f.pre_lookahead_len
    mel_ends = [ratio * (end - lookahead) for end in ends] + [offline.shape[-1]]
    out["hift_stream_mel_ends"] = np.array(mel_ends, np.int64)
    stream, start = CausalVocoderStream(hift), 0
    for i, end in enumerate(mel_ends):
        out[f"hift_stream_chunk{i}"] = stream.push(offline[:, :, start:end], finalize=i == len(mel_ends) - 1).numpy()
        start = end
    for i, chunk in enumerate(synthesize(flow, hift, prompt, tokens, official_policy(flow)).chunks):
        out[f"e2e_stream_chunk{i}"] = chunk.numpy()
    (offline_audio,) = synthesize(flow, hift, prompt, tokens, None).chunks
    out["e2e_nonstream"] = offline_audio.numpy()
    return out


def _onnx_arrays(model_dir: Path, rs: np.random.RandomState, n: Lengths) -> dict[str, np.ndarray]:
    campplus_in = rs.randn(1, n.campplus_frames, 80).astype(np.float32)
    campplus_in -= campplus_in.mean(axis=1, keepdims=True)
    tokenizer_in = rs.randn(1, 128, n.tokenizer_frames).astype(np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    campplus = ort.InferenceSession(str(model_dir / "campplus.onnx"), options, providers=["CPUExecutionProvider"])
    tokenizer = ort.InferenceSession(str(model_dir / COSYVOICE3.speech_tokenizer_file), options,
                                     providers=["CPUExecutionProvider"])
    return {"onnx_campplus_in": campplus_in, "onnx_campplus_out": campplus.run(None, {"input": campplus_in})[0],
            "onnx_tokenizer_in": tokenizer_in,
            "onnx_tokenizer_out": tokenizer.run(None, {"feats": tokenizer_in,
                                                       "feats_length": np.array([n.tokenizer_frames], np.int32)})[0]}
