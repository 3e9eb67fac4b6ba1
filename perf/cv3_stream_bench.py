"""Seconds per streaming chunk of CosyVoice3's flow and vocoder, the official way against the per-stream caches.

One stream on a CosyVoice3 folder (FULL_CV3: e.g. one written by `cosyvoice-triton export --family cosyvoice3
--size full`): a random `--prompt-tokens` prompt, `--speech-tokens` random speech tokens on the official chunk
schedule (first hop 25 plus the prompt pad, then 50, then 100, 3 look-ahead tokens each), then the final
full-attention call; the vocoder with the folder's fixed noise. Two modes, `--rounds` times, interleaved:
- official: every call runs the flow on all tokens so far and the vocoder on all mel so far, and keeps what
  is new (`CosyVoice3Model.token2wav`);
- cached: the flow through the stream's DiT cache (models/dit_cache.py, one estimator pass of both guidance
  halves per Euler step) and the windowed vocoder stream (token2wav/causal_vocoder_stream.py).
Prints a markdown table per chunk: flow and vocoder seconds (median over rounds), estimator frames and
vocoder frames, the cached / official ratio, the max abs difference of mel and audio from the official
way (and of the windowed vocoder's audio alone, fed the official mel), the cache size and the load average.

With `--bf16`: the first chunk's mel with the estimator under bf16 autocast against fp32 (SNR in dB), and
the cached bf16 call against the uncached bf16 one.

    python -m cosyvoice_triton.perf.cv3_stream_bench --model-dir FULL_CV3 --threads 2
    python -m cosyvoice_triton.perf.cv3_stream_bench --model-dir FULL_CV3 --threads 2 --bf16 --speech-tokens 40
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from cosyvoice_triton.family import COSYVOICE3
from cosyvoice_triton.messages import FlowPrompt
from cosyvoice_triton.models.dit_cache import cached_mel
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.flow_cache import StreamFlowCache
from cosyvoice_triton.pipeline.chunk_policy import ChunkSchedule
from cosyvoice_triton.token2wav.causal_vocoder_stream import CausalVocoderStream


def random_prompt(prompt_tokens: int, seed: int) -> FlowPrompt:
    rng = np.random.RandomState(seed)
    return FlowPrompt(speech_tokens=torch.from_numpy(rng.randint(0, 6561, (1, prompt_tokens)).astype(np.int32)),
                      mel=torch.from_numpy((rng.randn(1, 2 * prompt_tokens, 80) * 1.5 - 6).astype(np.float32)),
                      embedding=torch.from_numpy(rng.randn(1, 192).astype(np.float32)))


def official_ends(prompt_tokens: int, n_tokens: int) -> list[int]:
    """Token counts of the non-final calls of the official schedule; the final call takes all `n_tokens`."""
    schedule, ends = ChunkSchedule(COSYVOICE3.chunk, prompt_tokens), []
    while schedule.needed <= n_tokens:
        ends.append(schedule.advance()[1])
    return ends


def conditions(flow, prompt: FlowPrompt, tokens: torch.Tensor, final: bool):
    length = lambda n: torch.tensor([n], dtype=torch.int32)  # noqa: E731
    return flow.conditions(tokens, length(tokens.shape[1]), prompt.speech_tokens, length(prompt.speech_tokens.shape[1]),
                           prompt.mel, length(prompt.mel.shape[1]), prompt.embedding, streaming=not final,
                           finalize=final)


def official_stream(flow, hift, prompt: FlowPrompt, tokens: torch.Tensor, ends: list[int]) -> list[dict]:
    """Each call: the flow on all tokens so far, the vocoder on all mel so far; the new part of each kept."""
    calls, mel_so_far, sent, offset = [], None, 0, 0
    P, ratio = prompt.mel.shape[1], flow.config.token_mel_ratio
    for end in ends + [tokens.shape[1]]:
        final = end == tokens.shape[1]
        start = time.perf_counter()
        c = conditions(flow, prompt, tokens[:, :end], final)
        mel = flow.decoder(c.mu, c.mask, c.spks, c.cond, c.streaming)[:, :, P + ratio * offset:]
        flow_s = time.perf_counter() - start
        mel_so_far = mel if mel_so_far is None else torch.cat([mel_so_far, mel], dim=2)
        start = time.perf_counter()
        speech, _ = hift.inference(mel_so_far, finalize=final)
        vocoder_s = time.perf_counter() - start
        calls.append(dict(flow_s=flow_s, vocoder_s=vocoder_s, flow_frames=int(c.mel_len[0]),
                          vocoder_frames=mel_so_far.shape[2], mel=mel, audio=speech[:, sent:]))
        sent += calls[-1]["audio"].shape[1]
        offset = end - flow.config.pre_lookahead_len
    return calls


def cached_stream(flow, hift, prompt: FlowPrompt, tokens: torch.Tensor, ends: list[int]) -> list[dict]:
    """The same calls through the stream's DiT cache and the windowed vocoder stream."""
    calls, cache, offset, vocoder = [], StreamFlowCache(), 0, CausalVocoderStream(hift)
    P, ratio = prompt.mel.shape[1], flow.config.token_mel_ratio
    for end in ends + [tokens.shape[1]]:
        final = end == tokens.shape[1]
        start = time.perf_counter()
        c = conditions(flow, prompt, tokens[:, :end], final)
        mel, (first,), (kept,), _ = cached_mel(flow, c, [cache], [int(c.mel_len[0])], 10 ** 6)
        mel = mel[:, :, P + ratio * offset - first:int(c.mel_len[0]) - first]
        flow_s = time.perf_counter() - start
        cache_mb = kept.nbytes / 2 ** 20
        cache = kept
        window = mel.shape[2] + (0 if vocoder.mel is None else vocoder.mel.shape[2])
        start = time.perf_counter()
        audio = vocoder.push(mel, finalize=final)
        vocoder_s = time.perf_counter() - start
        calls.append(dict(flow_s=flow_s, vocoder_s=vocoder_s, flow_frames=int(c.mel_len[0]) - first,
                          vocoder_frames=window, mel=mel, audio=audio, cache_mb=cache_mb))
        offset = end - flow.config.pre_lookahead_len
    return calls


def vocoder_alone(hift, official: list[dict]) -> list[float]:
    """Max abs difference per chunk of the windowed vocoder stream fed the official mel from the official audio."""
    stream = CausalVocoderStream(hift)
    return [float((stream.push(call["mel"], finalize=i == len(official) - 1) - call["audio"]).abs().max())
            for i, call in enumerate(official)]


def snr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = float(((other.double() - reference.double()) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((reference.double() ** 2).sum()) / noise)


def bf16_check(flow, prompt: FlowPrompt, tokens: torch.Tensor, end: int) -> dict:
    """The first chunk's mel (prompt frames included) with the estimator in fp32 and under bf16 autocast."""
    c = conditions(flow, prompt, tokens[:, :end], final=False)
    fp32 = flow.decoder(c.mu, c.mask, c.spks, c.cond, c.streaming)
    flow.decoder.set_precision("bf16")
    try:
        start = time.perf_counter()
        bf16 = flow.decoder(c.mu, c.mask, c.spks, c.cond, c.streaming)
        bf16_s = time.perf_counter() - start
        cached, *_ = cached_mel(flow, c, [StreamFlowCache()], [int(c.mel_len[0])], 10 ** 6)
    finally:
        flow.decoder.set_precision("fp32")
    return dict(frames=int(c.mel_len[0]), snr_db=snr_db(fp32, bf16), bf16_s=bf16_s,
                cached_vs_uncached_bf16=float((cached - bf16).abs().max()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="a CosyVoice3 model folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--speech-tokens", type=int, default=250)
    parser.add_argument("--bf16", action="store_true", help="also the bf16 estimator against fp32 on the first chunk")
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = family_models(args.model_dir)
    flow, hift = models.load_flow(args.model_dir), models.load_vocoder(args.model_dir)
    prompt = random_prompt(args.prompt_tokens, 1)
    tokens = torch.from_numpy(np.random.RandomState(2).randint(0, 6561, (1, args.speech_tokens)).astype(np.int32))
    ends = official_ends(args.prompt_tokens, args.speech_tokens)
    load_start = os.getloadavg()[0]
    with torch.inference_mode():
        runs: dict[str, list[list[dict]]] = {"official": [], "cached": []}
        for _ in range(args.rounds):
            runs["official"].append(official_stream(flow, hift, prompt, tokens, ends))
            runs["cached"].append(cached_stream(flow, hift, prompt, tokens, ends))
        alone = vocoder_alone(hift, runs["official"][0])
        bf16 = bf16_check(flow, prompt, tokens, ends[0]) if args.bf16 else None
    load_end = os.getloadavg()[0]
    report(args, ends, runs, alone, bf16, (load_start, load_end))


def report(args, ends: list[int], runs: dict, alone: list[float], bf16: dict | None, load: tuple[float, float]) -> None:
    median = {mode: [{key: statistics.median(r[i][key] for r in rounds) for key in ("flow_s", "vocoder_s")}
                     for i in range(len(ends) + 1)] for mode, rounds in runs.items()}
    official, cached = runs["official"][0], runs["cached"][0]
    print(f"CosyVoice3 stream, {args.model_dir}: prompt {args.prompt_tokens} tokens, {args.speech_tokens} speech tokens, "
          f"calls at {ends + [args.speech_tokens]} tokens, {args.threads} threads, {args.rounds} round(s), "
          f"load average {load[0]:.1f}-{load[1]:.1f}\n")
    print("| chunk | flow s official | flow s cached | ratio | estimator frames official / cached | vocoder s official "
          "| vocoder s cached | ratio | vocoder frames official / cached | max abs mel | max abs audio | vocoder alone "
          "| cache MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (o, c) in enumerate(zip(official, cached)):
        mo, mc = median["official"][i], median["cached"][i]
        print(f"| {i} | {mo['flow_s']:.2f} | {mc['flow_s']:.2f} | {mc['flow_s'] / mo['flow_s']:.2f} "
              f"| {o['flow_frames']} / {c['flow_frames']} | {mo['vocoder_s']:.3f} | {mc['vocoder_s']:.3f} "
              f"| {mc['vocoder_s'] / mo['vocoder_s']:.2f} | {o['vocoder_frames']} / {c['vocoder_frames']} "
              f"| {float((o['mel'] - c['mel']).abs().max()):.1e} | {float((o['audio'] - c['audio']).abs().max()):.1e} "
              f"| {alone[i]:.1e} | {c['cache_mb']:.0f} |")
    totals = {mode: [sum(m[key] for m in median[mode]) for key in ("flow_s", "vocoder_s")] for mode in median}
    print(f"| total | {totals['official'][0]:.2f} | {totals['cached'][0]:.2f} "
          f"| {totals['cached'][0] / totals['official'][0]:.2f} | {sum(o['flow_frames'] for o in official)} / "
          f"{sum(c['flow_frames'] for c in cached)} | {totals['official'][1]:.3f} | {totals['cached'][1]:.3f} "
          f"| {totals['cached'][1] / totals['official'][1]:.2f} | {sum(o['vocoder_frames'] for o in official)} / "
          f"{sum(c['vocoder_frames'] for c in cached)} | | | | |")
    if bf16 is not None:
        print(f"\nbf16 estimator (autocast) on the first chunk ({bf16['frames']} frames, prompt included): mel SNR "
              f"{bf16['snr_db']:.1f} dB against fp32, {bf16['bf16_s']:.2f} s; cached against uncached in bf16: max abs "
              f"{bf16['cached_vs_uncached_bf16']:.1e}")
    if args.json:
        raw = {mode: [[{k: v for k, v in call.items() if k not in ("mel", "audio")} for call in r] for r in rounds]
               for mode, rounds in runs.items()}
        with open(args.json, "w") as f:
            json.dump(dict(ends=ends, load=load, runs=raw, bf16=bf16), f, indent=1)


if __name__ == "__main__":
    main()
