"""Time from the first text piece to the first audio: bistream text input against sentence mode.

The text arrives word by word at `--tokens-per-s` (an LLM agent writing it; default 10 text tokens per
second). Sentence mode is the WebSocket's default: a sentence is synthesized once its end mark has come, so
its first audio waits for the whole sentence. Bistream (`Pipeline.run_bistream`) feeds the LLM as the
words come. Both run the serving path in this process: the in-flight batching LLM scheduler
(`LLMScheduler`) and token2wav behind the shared `Pipeline`, one request at a time, the same voice,
text and seed; the numbers are medians of `--runs` runs of each, alternated, with the load average.

    python perf/bistream_latency.py --model-dir models/tiny --runs 3
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

SENTENCE = ("Streaming text reaches the speech model word by word as an agent writes it, "
            "so the voice can start long before the sentence is complete.")


def paced_words(text: str, encode, tokens_per_s: float, started: list[float]):
    """The words of `text`, each yielded once its tokens have "arrived" at tokens_per_s (first one at once)."""
    words = [w + " " for w in text.split(" ")[:-1]] + [text.split(" ")[-1]]
    due = 0.0
    for word in words:
        if not started:
            started.append(time.monotonic())
        wait = started[0] + due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        yield word
        due += len(encode(word)) / tokens_per_s


def first_chunk_after(chunks, started: list[float]) -> float:
    """Seconds from the first text piece to the first audio chunk; the rest of the request is cancelled."""
    with contextlib.closing(chunks):
        for chunk in chunks:
            if chunk.size:
                return time.monotonic() - started[0]
    raise RuntimeError("no audio")


def first_audio_bistream(pipeline, request, text: str, tokens_per_s: float) -> float:
    started: list[float] = []
    words = paced_words(text, pipeline.preprocessor.tokenizer.encode, tokens_per_s, started)
    return first_chunk_after(pipeline.run_bistream(request, words, stream=True), started)


def first_audio_sentences(pipeline, request, text: str, tokens_per_s: float) -> float:
    """Sentence mode: the words arrive at the same pace; synthesis starts at the sentence's end mark."""
    started: list[float] = []
    received = "".join(paced_words(text, pipeline.preprocessor.tokenizer.encode, tokens_per_s, started))
    return first_chunk_after(pipeline.run(replace(request, text=received), stream=True), started)


def build(model_dir: Path, threads: int):
    import soundfile as sf
    import torch

    from cosyvoice_triton.gateway import default_voice
    from cosyvoice_triton.models.speech_lm import SpeechLM
    from cosyvoice_triton.llm.scheduler import LLMScheduler
    from cosyvoice_triton.pipeline.local_stages import LocalLLMStage
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2

    torch.set_num_threads(threads)
    tts = CosyVoice2.from_model_dir(model_dir)
    llm = SpeechLM.from_model_dir(model_dir, max_batch=2, max_seq_len=2048)
    scheduler = LLMScheduler(llm, max_batch=2, max_seq_len=2048)
    scheduler.start()
    tts.pipeline.llm = LocalLLMStage(scheduler)
    audio, rate = sf.read(default_voice.RECORDING, dtype="float32")
    voice = tts.encode_voice(audio, rate, default_voice.TRANSCRIPT)
    return tts, scheduler, voice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokens-per-s", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", default=SENTENCE)
    args = parser.parse_args()

    from cosyvoice_triton.messages import SynthesisRequest

    tts, scheduler, voice = build(args.model_dir, args.threads)
    request = SynthesisRequest(text="", voice=voice, seed=args.seed, sampling=tts.llm.config.sampling)
    text_tokens = len(tts.preprocessor.tokenizer.encode(args.text))
    results: dict[str, list[float]] = {"sentences": [], "bistream": []}
    loads = [os.getloadavg()[0]]
    try:
        for _ in range(args.runs):
            results["bistream"].append(first_audio_bistream(tts.pipeline, request, args.text, args.tokens_per_s))
            results["sentences"].append(first_audio_sentences(tts.pipeline, request, args.text,
                                                              args.tokens_per_s))
            loads.append(os.getloadavg()[0])
    finally:
        scheduler.stop()
    first = {mode: statistics.median(runs) for mode, runs in results.items()}
    report = {"model_dir": str(args.model_dir), "text_tokens": text_tokens, "tokens_per_s": args.tokens_per_s,
              "text_arrival_s": text_tokens / args.tokens_per_s, "runs": args.runs,
              "first_audio_s": first, "bistream_over_sentences": first["bistream"] / first["sentences"],
              "first_audio_runs_s": results,
              "load_average_1m": {"min": min(loads), "max": max(loads)}, "cores": os.cpu_count()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
