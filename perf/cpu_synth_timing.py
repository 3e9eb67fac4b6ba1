"""Time the in-process pipeline on this machine: ~10 s of audio, offline and streaming.

    python -m cosyvoice_triton.perf.cpu_synth_timing --model-dir DIR [--seconds 10] [--repeats 2]

A random LLM almost never samples a stop token, so it speaks max_len = 20 x the text tokens; the text
is chosen to give the requested audio length (25 tokens per second). Prints one table row per mode.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from cosyvoice_triton.messages import SynthesisRequest
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old green tree".split()


def text_with_tokens(tts: CosyVoice2, tokens: int) -> str:
    words: list[str] = []
    while len(tts.preprocessor.tokenizer.encode(" ".join(words))) < tokens:
        words.append(WORDS[len(words) % len(WORDS)])
    return " ".join(words)


def run_once(tts: CosyVoice2, request: SynthesisRequest, stream: bool) -> tuple[float, float, float]:
    """(first chunk s, total s, audio s)"""
    start = time.perf_counter()
    first, samples = None, 0
    for chunk in tts.synthesize(request, stream=stream):
        first = first if first is not None else time.perf_counter() - start
        samples += chunk.size
    return first, time.perf_counter() - start, samples / tts.sample_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    tts = CosyVoice2.from_model_dir(args.model_dir)
    load_s = time.perf_counter() - t0
    voice = tts.encode_voice(speech_like(3.0, 16000), 16000, "hello there")
    text = text_with_tokens(tts, round(args.seconds * 25 / 20))
    print(f"model {args.model_dir}: loaded in {load_s:.1f} s; {torch.get_num_threads()} threads; text {text!r}")
    print("| mode | first chunk (s) | total (s) | audio (s) | RTF |")
    print("|---|---:|---:|---:|---:|")
    for stream in (False, True):
        runs = [run_once(tts, SynthesisRequest(text=text, voice=voice, seed=1), stream) for _ in range(args.repeats)]
        first, total, audio = (float(np.median([r[i] for r in runs])) for i in range(3))
        print(f"| {'streaming' if stream else 'offline'} | {first:.2f} | {total:.2f} | {audio:.1f} | {total / audio:.3f} |")


if __name__ == "__main__":
    main()
