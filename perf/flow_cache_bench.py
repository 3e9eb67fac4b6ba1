"""Flow seconds per streaming chunk with and without the per-stream flow cache (models/flow_cache.py).

One stream on a model folder (FULL_MODEL: e.g. one written by `cosyvoice-triton export --size full`): a random 75-token prompt, 250 random
speech tokens cut into 28 / 50 / 100 / rest chunks (the 3 look-ahead tokens inside each), HiFT noise zeroed.
Three modes run one after the other, `--rounds` times (interleaved): the flow cache off, on (the final chunk
one full-attention pass, the default) and on with the cached streaming final chunk. Prints a markdown table
of flow seconds per chunk, the cache size, the load average, and each mode's audio against the uncached run
(the official algorithm) by the quality judge (perf/quality.py): the log-mel distance of the flow's mel, the
waveform's MCD, and the sample-wise SNR beside (not a judge).

With `--prompt-cache`: the first flow call of a new stream of a voice seen before, started from the voice's
kept frames (models/prompt_cache.py) against the same call with the prompt cache off, interleaved, median of
`--rounds`; prints the seconds, the memory per voice and the mel difference.

    python -m cosyvoice_triton.perf.flow_cache_bench --model-dir FULL_MODEL --threads 2
    python -m cosyvoice_triton.perf.flow_cache_bench --model-dir FULL_MODEL --threads 2 --prompt-cache --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from cosyvoice_triton.messages import FlowPrompt
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.flow_cache import FlowCacheSettings
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.hift_source import ZeroNoise
from cosyvoice_triton.perf.quality import judge
from cosyvoice_triton.token2wav.stream import Token2Wav

MODES = {"uncached": FlowCacheSettings(enabled=False), "cached": FlowCacheSettings(max_frames=10 ** 6),
         "cached_final": FlowCacheSettings(max_frames=10 ** 6, cached_final=True)}
CHUNKS = [28, 50, 100]  # then the rest


class TimedToken2Wav(Token2Wav):
    """Token2Wav that records the seconds of every flow call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds: list[float] = []
        self.mels: list[torch.Tensor] = []

    def mel(self, *args, **kwargs) -> torch.Tensor:
        start = time.perf_counter()
        mel = super().mel(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        self.mels.append(mel)
        return mel


def run_stream(token2wav: TimedToken2Wav, prompt: FlowPrompt, tokens: list[int]) -> tuple[np.ndarray, int]:
    """Audio of the whole stream, and the cache's bytes before the final chunk."""
    stream = token2wav.stream(prompt, ZeroNoise())
    audio, sent, cache_bytes = [], 0, 0
    for size in CHUNKS:
        audio.append(stream.chunk(tokens[sent:sent + size], finalize=False))
        sent += size
    if stream.flow_cache is not None:
        cache_bytes = stream.flow_cache.nbytes
    audio.append(stream.chunk(tokens[sent:], finalize=True))
    return np.concatenate(audio), cache_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True,
                        help="model folder, e.g. one written by `cosyvoice-triton export --size full`")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--speech-tokens", type=int, default=250)
    parser.add_argument("--prompt-cache", action="store_true",
                        help="time a new stream's first flow call seeded with its voice's frames, against unseeded")
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flow, hift = FlowModel.from_model_dir(args.model_dir), HiFTGenerator.from_model_dir(args.model_dir)
    rng = np.random.RandomState(0)
    P = args.prompt_tokens
    prompt = FlowPrompt(speech_tokens=torch.from_numpy(rng.randint(0, 6561, size=(1, P)).astype(np.int32)),
                        mel=torch.from_numpy((rng.randn(1, 2 * P, 80) - 5).astype(np.float32)),
                        embedding=torch.from_numpy(rng.randn(1, 192).astype(np.float32)))
    tokens = rng.randint(0, 6561, size=args.speech_tokens).tolist()
    if args.prompt_cache:
        prompt_cache_bench(flow, hift, prompt, tokens, args)
        return

    results: dict[str, dict] = {mode: {"seconds": [], "load": []} for mode in MODES}
    for _ in range(args.rounds):
        for mode, settings in MODES.items():
            token2wav = TimedToken2Wav(flow, hift, settings)
            load_before = os.getloadavg()[0]
            audio, cache_bytes = run_stream(token2wav, prompt, tokens)
            results[mode]["seconds"].append(token2wav.seconds)
            results[mode]["load"].append((load_before, os.getloadavg()[0]))
            mel = torch.cat(token2wav.mels, dim=2)[0].numpy()  # (80, T) the emitted frames
            results[mode].update(audio=audio, mel=mel, cache_bytes=cache_bytes)

    reference = results["uncached"]["audio"]
    print(f"flow seconds per chunk ({P}-token prompt, chunks {CHUNKS} + rest of {args.speech_tokens}, "
          f"{args.threads} threads; best of {args.rounds})\n")
    print("| mode | " + " | ".join(f"chunk {i + 1}" for i in range(len(CHUNKS) + 1))
          + " | total | total / uncached | cache before final | vs uncached: flow mel distance | waveform MCD "
          "| waveform SNR | load avg |")
    print("|---|" + "---:|" * (len(CHUNKS) + 8))
    best_total = {mode: min(map(sum, r["seconds"])) for mode, r in results.items()}
    for mode, r in results.items():
        best = min(r["seconds"], key=sum)
        loads = ", ".join(f"{a:.1f}-{b:.1f}" for a, b in r["load"])
        scores = judge(hift.config.sampling_rate, reference, r["audio"], results["uncached"]["mel"], r["mel"])
        print(f"| {mode} | " + " | ".join(f"{s:.2f}" for s in best)
              + f" | {sum(best):.2f} | {best_total[mode] / best_total['uncached']:.2f} "
              f"| {r['cache_bytes'] / 2 ** 20:.0f} MiB | {scores.flow_mel_distance_db:.3f} dB | {scores.mcd_db:.3f} dB "
              f"| {scores.wave_snr_db:.1f} dB | {loads} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({mode: {k: v for k, v in r.items() if k not in ("audio", "mel")} for mode, r in results.items()},
                      f)


def prompt_cache_bench(flow: FlowModel, hift: HiFTGenerator, prompt: FlowPrompt, tokens: list[int], args) -> None:
    """A new stream's first flow call (CHUNKS[0] tokens) with and without its voice's kept frames."""
    seeded = TimedToken2Wav(flow, hift, FlowCacheSettings())
    unseeded = TimedToken2Wav(flow, hift, FlowCacheSettings(prompt_cache_mb=0))
    seeded.stream(prompt, ZeroNoise()).chunk(tokens[:CHUNKS[0]], finalize=False)  # the voice's first stream
    (voice,) = seeded.prompt_cache._entries.values()
    seeded.seconds.clear()
    seeded.mels.clear()
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for token2wav in (unseeded, seeded):
            token2wav.stream(prompt, ZeroNoise()).chunk(tokens[:CHUNKS[0]], finalize=False)
            loads.append(os.getloadavg()[0])
    diff = max(float((a - b).abs().max()) for a, b in zip(seeded.mels, unseeded.mels))
    un, se = float(np.median(unseeded.seconds)), float(np.median(seeded.seconds))
    print(f"first flow call of a new stream ({args.prompt_tokens}-token prompt + {CHUNKS[0]} tokens, "
          f"{args.threads} threads, median of {args.rounds}, interleaved)\n")
    print("| | unseeded | seeded (voice's frames kept) | seeded / unseeded | voice frames | memory per voice "
          "| max abs mel diff | load avg |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    print(f"| seconds | {un:.2f} | {se:.2f} | {se / un:.2f} | {voice.frames} | {voice.nbytes / 2 ** 20:.0f} MiB "
          f"| {diff:.1e} | {min(loads):.1f}-{max(loads):.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unseeded": unseeded.seconds, "seeded": seeded.seconds, "voice_frames": voice.frames,
                       "voice_bytes": voice.nbytes, "max_abs_mel_diff": diff, "loads": loads}, f)


if __name__ == "__main__":
    main()
