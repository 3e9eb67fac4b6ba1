"""The flow estimator's reduced precision against fp32, after all 10 Euler steps: mel and waveform SNR.

    python -m cosyvoice_triton.perf.flow_quality --model-dir DIR [--speech-tokens 250] [--prompt-tokens 75] \
        [--precision bf16|int8-dynamic] [--seeds 0 1] [--json]

For each seed: one voice (a speech-like recording of P / 25 s through our prompt encoder) and N random
speech tokens; the flow in fp32 and in `--precision`, everything else alike (HiFT fp32, the same noise):
- offline: one full-attention pass over all N tokens (the official non-streamed path) -> mel SNR and the
  vocoded waveform's SNR;
- streamed: the official chunk schedule through a `Token2WavStream` with the flow caches on (as served)
  -> the whole stream's waveform SNR;
- the quick chunk preset (pipeline/chunk_policy.py) in fp32 against the official schedule in fp32: what
  `serve --chunk-preset quick` changes in the audio.
SNR = 10 log10(sum ref^2 / sum (ref - test)^2), in dB. The bound for a default precision is 30 dB
(perf/RESULTS.md). Printed as a markdown table (or one JSON object with --json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from cosyvoice_triton.messages import FlowPrompt
from cosyvoice_triton.models.flow import FLOW_PRECISIONS
from cosyvoice_triton.models.hift_source import GeneratorNoise
from cosyvoice_triton.perf.bench_official import PROMPT_RATE, PROMPT_TEXT, prompt_recording
from cosyvoice_triton.pipeline.chunk_policy import CHUNK_PRESETS, ChunkSchedule

SNR_BOUND_DB = 30.0


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    error = float(np.sum((reference.astype(np.float64) - test) ** 2))
    return float("inf") if error == 0 else 10 * np.log10(float(np.sum(reference.astype(np.float64) ** 2)) / error)


def offline(token2wav, prompt: FlowPrompt, tokens: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(mel (80, T), waveform (S,)) of one full-attention pass over every token."""
    mel = token2wav.mel(torch.tensor([tokens], dtype=torch.int32), prompt, 0, finalize=True, streaming=False)
    stream = token2wav.stream(prompt, GeneratorNoise(torch.Generator().manual_seed(seed)))
    audio = stream.vocoder.push(mel, finalize=True)
    stream.close()
    return mel[0].float().numpy(), audio.squeeze(0).float().numpy()


def streamed(token2wav, prompt: FlowPrompt, tokens: list[int], seed: int, preset: str = "official") -> np.ndarray:
    """The waveform of a chunk preset's schedule (default: the official one), chunk by chunk, as a served
    stream makes it."""
    chosen = CHUNK_PRESETS[preset]
    schedule = ChunkSchedule(chosen.policy(), len(prompt.speech_tokens[0]))
    token2wav.flow_cache = dataclasses.replace(token2wav.flow_cache, cached_final=chosen.cached_final)
    stream = token2wav.stream(prompt, GeneratorNoise(torch.Generator().manual_seed(seed)))
    audio, sent = [], 0
    while schedule.due(len(tokens)):
        _, end = schedule.advance()
        audio.append(stream.chunk(tokens[sent:end], finalize=False))
        sent = end
    audio.append(stream.chunk(tokens[sent:], finalize=True))
    return np.concatenate(audio)


def measure(model_dir: str, speech_tokens: int, prompt_tokens: int, precision: str, seeds: list[int]) -> dict:
    from cosyvoice_triton.engines.select import build_token2wav
    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2
    from cosyvoice_triton.pipeline.pipeline import flow_prompt_of
    from cosyvoice_triton.token2wav.stream import Token2Wav, prompt_tensors

    tts = CosyVoice2.from_model_dir(model_dir)
    token2wav = tts.token2wav
    # A second flow + HiFT in `precision` (int8-dynamic quantizes in place, so not the same modules toggled).
    tested = Token2Wav(*build_token2wav(model_dir, flow_precision=precision), token2wav.flow_cache)
    voice = tts.encode_voice(prompt_recording(prompt_tokens), PROMPT_RATE, PROMPT_TEXT)
    prompt = prompt_tensors(flow_prompt_of(voice))
    rows = []
    for seed in seeds:
        tokens = torch.randint(0, token2wav.flow.config.vocab_size, (speech_tokens,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        mel, wave, stream = *offline(token2wav, prompt, tokens, seed), streamed(token2wav, prompt, tokens, seed)
        mel_t, wave_t, stream_t = *offline(tested, prompt, tokens, seed), streamed(tested, prompt, tokens, seed)
        quick = streamed(token2wav, prompt, tokens, seed, "quick")  # fp32, the quick preset's chunks
        rows.append({"seed": seed, "mel_snr_db": snr_db(mel, mel_t), "offline_wave_snr_db": snr_db(wave, wave_t),
                     "streamed_wave_snr_db": snr_db(stream, stream_t), "audio_s": stream.size / 24000,
                     "quick_preset_snr_db": snr_db(stream, quick[:stream.size]) if quick.size == stream.size
                     else float("nan")})
    return {"model_dir": model_dir, "precision": precision, "speech_tokens": speech_tokens,
            "prompt_tokens": prompt_tokens, "bound_db": SNR_BOUND_DB, "seeds": rows,
            "min_db": min(min(r["mel_snr_db"], r["offline_wave_snr_db"], r["streamed_wave_snr_db"]) for r in rows)}


def markdown(result: dict) -> str:
    lines = [f"flow estimator {result['precision']} against fp32; {result['speech_tokens']} speech tokens, "
             f"{result['prompt_tokens']}-token prompt; bound {result['bound_db']:.0f} dB", "",
             "| seed | mel SNR | offline waveform SNR | streamed waveform SNR | quick preset vs official (fp32) |",
             "|---:|---:|---:|---:|---:|"]
    for row in result["seeds"]:
        lines.append(f"| {row['seed']} | {row['mel_snr_db']:.1f} dB | {row['offline_wave_snr_db']:.1f} dB | "
                     f"{row['streamed_wave_snr_db']:.1f} dB | {row['quick_preset_snr_db']:.1f} dB |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--speech-tokens", type=int, default=250)
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--precision", default="bf16", choices=[p for p in FLOW_PRECISIONS if p != "fp32"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.model_dir, args.speech_tokens, args.prompt_tokens, args.precision, args.seeds)
    print(json.dumps(result) if args.json else markdown(result))


if __name__ == "__main__":
    main()
