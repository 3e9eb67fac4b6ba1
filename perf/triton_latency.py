"""First-chunk latency and RTF of a running CosyVoice2 Triton server, by concurrency.

    python -m cosyvoice_triton.perf.triton_latency --triton localhost:8001 [--concurrency 1 4] [--rounds 3]
        [--text "..."] [--warmup 1]

Registers a locally made prompt voice once, then runs `rounds` rounds of `concurrency` simultaneous
gRPC streams and prints one markdown row per concurrency: first chunk mean/p50/max, per-request RTF
and aggregate RTF (wall time of all rounds / audio produced). A small tool for notes and checks; the
full benchmark (scenarios, percentiles, plots) belongs to `cosyvoice-triton bench`.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

from cosyvoice_triton.client.triton_client import TritonTTS
from cosyvoice_triton.random_folder.sample_prompt import speech_like

DEFAULT_TEXT = "the quick brown fox jumps over a lazy dog while"


def one_request(url: str, text: str, voice_id: str, seed: int, results: list) -> None:
    with TritonTTS(url, timeout_s=3600) as tts, tts.stream(text, voice_id=voice_id, seed=seed) as chunks:
        started = time.monotonic()
        for _ in chunks:
            pass
        wall = time.monotonic() - started
        results.append((chunks.stats.first_chunk_s, wall, chunks.stats.audio_seconds))


def run_round(url: str, text: str, voice_id: str, concurrency: int, seed: int, results: list) -> None:
    threads = [threading.Thread(target=one_request, args=(url, text, voice_id, seed + k, results))
               for k in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton", default="localhost:8001")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--text", default=DEFAULT_TEXT)
    args = parser.parse_args()

    with TritonTTS(args.triton) as tts:
        voice = tts.register_voice(speech_like(3.0, 16000, seed=1), sample_rate=16000,
                                   prompt_text="a voice prompt of three seconds").voice_id
    for _ in range(args.warmup):
        run_round(args.triton, args.text, voice, 1, 0, [])
    print("| concurrency | requests | audio per request (s) | first chunk mean / p50 / max (ms) | RTF per request | aggregate RTF |")
    print("|---:|---:|---:|---|---:|---:|")
    for concurrency in args.concurrency:
        results: list = []
        started = time.monotonic()
        for r in range(args.rounds):
            run_round(args.triton, args.text, voice, concurrency, 1000 * r, results)
        total = time.monotonic() - started
        firsts = sorted(1000 * r[0] for r in results)
        audio = sum(r[2] for r in results)
        print(f"| {concurrency} | {len(results)} | {audio / len(results):.2f} | {statistics.mean(firsts):.0f} / "
              f"{statistics.median(firsts):.0f} / {firsts[-1]:.0f} | "
              f"{statistics.mean(r[1] / r[2] for r in results):.3f} | {total / audio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
