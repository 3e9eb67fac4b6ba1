"""Side by side with the official CosyVoice2 code, on one model folder, in one interleaved run.

    python -m cosyvoice_triton.perf.bench_official --model-dir DIR --official-src CHECKOUT \
        [--official-venv VENV] [--speech-tokens 250] [--text-tokens 40] [--prompt-tokens 75] \
        [--concurrency 1 4] [--repeats 2] [--out DIR]
    python -m cosyvoice_triton.perf.bench_official --model-dir DIR --speech-tokens N --text-tokens T \
        --prompt-tokens P --json            # our side alone, in-process: one JSON object on stdout

Both sides get the same text token ids, prompt text ids, prompt speech tokens, prompt mel and speaker
embedding (computed once by our prompt encoder from a speech-like recording of P / 25 s) and decode
exactly N speech tokens (stop tokens masked; `generate(exact_len=N)` here, the same masking patched
into the official `Qwen2LM` by perf/official_driver.py). Each side runs in its own process (the
official one with the official virtualenv's python, made with `python -m venv` + pip when
`--official-venv` is not given) and the rounds alternate official, ours, official, ours, ... for every
concurrency level, each round recorded with the load average. c concurrent streams: c threads calling
`CosyVoice2Model.tts(stream=True)` on the official side; c synthesizers, one thread each, on ours.
Writes side_by_side.md (ratios ours / official) and side_by_side.json under --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import venv
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "official_driver.py"
TOKENS_PER_S = 25
# What the official import path needs in its own virtualenv (torch: the CPU build this project pins).
OFFICIAL_PACKAGES = ["torch==2.13.0", "transformers==4.51.3", "diffusers==0.29.0", "hyperpyyaml", "conformer",
                     "omegaconf", "hydra-core", "lightning", "einops", "librosa", "inflect", "onnxruntime",
                     "matplotlib", "rootutils", "gdown", "wget"]
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old green tree".split()


# ---- inputs --------------------------------------------------------------------------------------

def text_with_tokens(tokenize, tokens: int) -> str:
    """The shortest text of WORDS whose tokenization has at least `tokens` ids."""
    words: list[str] = [WORDS[0]]
    while len(tokenize(" ".join(words))) < tokens:
        words.append(WORDS[len(words) % len(WORDS)])
    return " ".join(words)


def make_inputs(tts, text_tokens: int, prompt_tokens: int):
    """(SynthesisRequest, the same request as arrays for the official side)."""
    from cosyvoice_triton.messages import SynthesisRequest
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    rate = 16000
    voice = tts.encode_voice(speech_like(prompt_tokens / TOKENS_PER_S + 0.2, rate), rate, "hello there")
    tokens = np.asarray(voice.speech_tokens)[:prompt_tokens]
    voice = dataclasses.replace(voice, speech_tokens=tokens, mel=np.asarray(voice.mel)[:2 * len(tokens)])

    def sentences(text: str):  # the LLM requests the pipeline makes of `text` (normalized, split, tokenized)
        return tts.orchestrator.llm_requests(SynthesisRequest(text=text, voice=voice, seed=1), "bench", 1)

    text = text_with_tokens(lambda text: sentences(text)[0].text_tokens, text_tokens)
    request = SynthesisRequest(text=text, voice=voice, seed=1)
    [llm_request] = sentences(text)
    arrays = {"text_tokens": np.asarray(llm_request.text_tokens, dtype=np.int32),
              "prompt_text_tokens": np.asarray(llm_request.prompt_text_tokens, dtype=np.int32),
              "prompt_speech_tokens": np.asarray(llm_request.prompt_speech_tokens, dtype=np.int32),
              "embedding": np.asarray(voice.embedding, dtype=np.float32),
              "mel": np.asarray(voice.mel, dtype=np.float32)}
    return request, arrays


# ---- our side --------------------------------------------------------------------------------------

class OurSide:
    """c synthesizers of one folder (each is one request at a time), each stream exactly N tokens."""

    def __init__(self, model_dir: str, speech_tokens: int, text_tokens: int, prompt_tokens: int,
                 llm_precision: str = "fp32"):
        from cosyvoice_triton.runtime.synthesizer import CosyVoice2

        self.load = lambda: CosyVoice2.from_model_dir(model_dir, llm_precision=llm_precision)
        self.synths = [self.load()]
        self.speech_tokens = speech_tokens
        for tts in self.synths:
            tts.exact_speech_tokens(speech_tokens)
        self.request, self.arrays = make_inputs(self.synths[0], text_tokens, prompt_tokens)

    def round(self, concurrency: int) -> dict:
        while len(self.synths) < concurrency:
            tts = self.load()
            tts.exact_speech_tokens(self.speech_tokens)
            self.synths.append(tts)
        results = [{} for _ in range(concurrency)]
        threads = [threading.Thread(target=self._stream, args=(self.synths[i], results[i])) for i in range(concurrency)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return {"streams": results, "wall_s": time.perf_counter() - start}

    def _stream(self, tts, result: dict) -> None:
        start = time.perf_counter()
        first, samples, chunks = None, 0, 0
        for chunk in tts.synthesize(self.request, stream=True):
            if chunk.size and first is None:
                first = time.perf_counter() - start
            samples += chunk.size
            chunks += 1
        result.update(first_s=first, total_s=time.perf_counter() - start, audio_s=samples / tts.sample_rate,
                      chunks=chunks)


def serve_ours(args) -> None:
    """Worker mode: the line protocol of official_driver.py, for our side."""
    import torch

    torch.set_num_threads(args.threads)
    protocol, sys.stdout = sys.stdout, sys.stderr
    side = OurSide(args.model_dir, args.speech_tokens, args.text_tokens, args.prompt_tokens, args.llm_precision)
    np.savez(args.write_inputs, **side.arrays)
    protocol.write(json.dumps({"ready": True, "torch": torch.__version__}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        protocol.write(json.dumps(side.round(int(json.loads(line)["concurrency"]))) + "\n")
        protocol.flush()


# ---- the two processes -----------------------------------------------------------------------------

class Side:
    """A worker process answering one JSON line per {"concurrency": c}."""

    def __init__(self, name: str, command: list[str]):
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} side exited with {self.process.wait()} (see its stderr above)")
        return json.loads(line)

    def round(self, concurrency: int) -> dict:
        self.process.stdin.write(json.dumps({"concurrency": concurrency}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def official_python(venv_dir: Path | None, work: Path) -> Path:
    """The official virtualenv's python: the given one, or a new venv with OFFICIAL_PACKAGES."""
    if venv_dir is not None:
        return venv_dir / "bin" / "python"
    venv_dir = work / "official-venv"
    venv.EnvBuilder(with_pip=True).create(venv_dir)
    python = venv_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", *OFFICIAL_PACKAGES], check=True)
    return python


def ours_command(args, inputs: Path) -> list[str]:
    return [sys.executable, "-m", "cosyvoice_triton.perf.bench_official", "--worker", "--model-dir", args.model_dir,
            "--speech-tokens", str(args.speech_tokens), "--text-tokens", str(args.text_tokens),
            "--prompt-tokens", str(args.prompt_tokens), "--threads", str(args.threads),
            "--llm-precision", args.llm_precision, "--write-inputs", str(inputs)]


def official_command(python: Path, args, inputs: Path) -> list[str]:
    return [str(python), str(DRIVER), "--official-src", str(args.official_src), "--model-dir", args.model_dir,
            "--inputs", str(inputs), "--speech-tokens", str(args.speech_tokens), "--threads", str(args.threads)]


# ---- report ----------------------------------------------------------------------------------------

def summary(rounds: list[dict]) -> dict:
    """Medians over a side's rounds at one concurrency."""
    firsts = [s["first_s"] for r in rounds for s in r["streams"]]
    return {"first_audio_s": statistics.median(firsts),
            "first_audio_p90_s": float(np.percentile(firsts, 90)),
            "total_s": statistics.median(s["total_s"] for r in rounds for s in r["streams"]),
            "audio_s_per_s": statistics.median(sum(s["audio_s"] for s in r["streams"]) / r["wall_s"] for r in rounds),
            "audio_s": rounds[0]["streams"][0]["audio_s"], "rounds": len(rounds)}


ROWS = [("first audio (median)", "first_audio_s", "s"), ("first audio p90", "first_audio_p90_s", "s"),
        ("total per stream (median)", "total_s", "s"), ("audio seconds per second", "audio_s_per_s", "")]


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"{meta['date']}; {meta['cpu']}; torch {meta['torch_ours']} (ours) / {meta['torch_official']} (official), "
             f"{meta['threads']} threads each; {meta['text_tokens']} text tokens, {meta['prompt_tokens']}-token prompt, "
             f"exactly {meta['speech_tokens']} speech tokens; LLM {meta['llm_precision']}; load average "
             f"{meta['load_min']:.1f}-{meta['load_max']:.1f} over the rounds", "",
             "| c | | official | ours | ours / official |", "|---:|---|---:|---:|---:|"]
    for level in result["levels"]:
        official, ours = level["official"], level["ours"]
        for label, key, unit in ROWS:
            lines.append(f"| {level['concurrency']} | {label} | {official[key]:.2f}{unit} | {ours[key]:.2f}{unit} | "
                         f"{ours[key] / official[key]:.2f} |")
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def side_by_side(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-official-"))
    inputs = work / "inputs.npz"
    ours = Side("our", ours_command(args, inputs))
    official = Side("official", official_command(official_python(args.official_venv, work), args, inputs))
    rounds: dict[tuple[int, str], list[dict]] = {}
    loads: list[float] = []
    try:
        for _ in range(args.repeats):
            for level in args.concurrency:
                for side in (official, ours):  # A, B, A, B: both see the same load on the machine
                    loads.append(os.getloadavg()[0])
                    result = side.round(level)
                    result["load_average"] = loads[-1]
                    rounds.setdefault((level, side.name), []).append(result)
                    print(f"c={level} {side.name}: wall {result['wall_s']:.1f} s, load {loads[-1]:.1f}", file=sys.stderr)
    finally:
        ours.close()
        official.close()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
            "torch_ours": ours.hello["torch"], "torch_official": official.hello["torch"], "threads": args.threads,
            "text_tokens": len(np.load(inputs)["text_tokens"]), "prompt_tokens": args.prompt_tokens,
            "speech_tokens": args.speech_tokens, "llm_precision": args.llm_precision, "load_min": min(loads),
            "load_max": max(loads), "model_dir": args.model_dir}
    return write_report(out, meta, args.concurrency, rounds)


def write_report(out: Path, meta: dict, levels: list[int], rounds: dict[tuple[int, str], list[dict]]) -> dict:
    """side_by_side.json and side_by_side.md under `out` from each (level, side)'s rounds."""
    result = {"meta": meta,
              "levels": [{"concurrency": level, "official": summary(rounds[(level, "official")]),
                          "ours": summary(rounds[(level, "our")])} for level in levels],
              "rounds": {f"c{level}_{name}": r for (level, name), r in rounds.items()}}
    (out / "side_by_side.json").write_text(json.dumps(result, indent=1))
    (out / "side_by_side.md").write_text(markdown(result))
    return result


def ours_alone(args) -> dict:
    """The public timing entry: our side alone, in-process, one round per concurrency level."""
    import torch

    torch.set_num_threads(args.threads)
    side = OurSide(args.model_dir, args.speech_tokens, args.text_tokens, args.prompt_tokens, args.llm_precision)
    levels = []
    for level in args.concurrency:
        load = os.getloadavg()[0]
        rounds = [side.round(level) for _ in range(args.repeats)]
        levels.append({"concurrency": level, "load_average": load, **summary(rounds)})
    return {"speech_tokens": args.speech_tokens, "text_tokens": len(side.arrays["text_tokens"]),
            "prompt_tokens": len(side.arrays["prompt_speech_tokens"]), "llm_precision": args.llm_precision,
            "torch": torch.__version__, "threads": args.threads, "cpu": cpu_name(), "levels": levels}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--official-src", type=Path, help="checkout of the official repository (with "
                                                          "third_party/Matcha-TTS); without it, our side alone")
    parser.add_argument("--official-venv", type=Path, help="its virtualenv (default: made under a temp folder)")
    parser.add_argument("--speech-tokens", type=int, default=250)
    parser.add_argument("--text-tokens", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side")
    parser.add_argument("--llm-precision", default="fp32", choices=["fp32", "bf16", "int8"])
    parser.add_argument("--out", default="bench_official_out")
    parser.add_argument("--json", action="store_true", help="our side alone: print its JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write-inputs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        serve_ours(args)
    elif args.official_src is None:
        result = ours_alone(args)
        print(json.dumps(result, indent=None if args.json else 1))
    else:
        print(markdown(side_by_side(args)))


if __name__ == "__main__":
    main()
