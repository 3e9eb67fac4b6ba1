"""Side by side with the official CosyVoice2 or CosyVoice3 code, on one model folder, in one interleaved run.

    python -m cosyvoice_triton.perf.bench_official --model-dir DIR --official-src CHECKOUT \
        [--official-venv VENV] [--speech-tokens 250] [--text-tokens 40] [--prompt-tokens 75] \
        [--concurrency 1 4] [--repeats 2] [--device cpu|cuda] [--out DIR]
    cosyvoice-triton bench-official ...     # the same, as a subcommand
    cosyvoice-triton bench-official --model-dir DIR --speech-tokens N --text-tokens T --prompt-tokens P \
        --json [--triton HOST:PORT] [--decode-ahead on|off|both] [--first-chunk alone|shared|both]
                                            # our side alone: one JSON object on stdout

Both sides get the same text token ids, prompt text ids, prompt speech tokens, prompt mel and speaker
embedding (computed once by our prompt encoder from a speech-like recording of P / 25 s) and decode
exactly N speech tokens (stop tokens masked: our LLM made exact-length by perf/exact_length.py, the same
masking patched into the official LM by perf/official_driver.py). The folder's yaml decides the family on
both sides (ours: `CosyVoice.from_model_dir`; the official: `CosyVoice2Model` or `CosyVoice3Model`). Each side
runs in its own process (the
official one with the official virtualenv's python, made with `python -m venv` + pip when
`--official-venv` is not given) and the rounds alternate official, ours, official, ours, ... for every
concurrency level, each round recorded with the load average. c concurrent streams: c threads calling
the official model's `tts(stream=True)`; c synthesizers, one thread each, on ours.
Writes side_by_side.md (ratios ours / official) and side_by_side.json under --out. Every side reports
first audio (its first chunk) and first audible audio (the arrival of the chunk holding its first sample
above -50 dBFS over 10 ms, cosyvoice_triton/pipeline/audible.py, computed from that side's own chunks;
the official driver loads that module by path).

Our side alone (no --official-src) times the in-process pipeline, and with `--triton HOST:PORT` also a
running tritonserver of the same folder (started with `python -m cosyvoice_triton.perf.exact_length
--exact-speech-tokens N`: `serve` with perf's exact-length `llm` overlay; the streaming model named as the
folder's family, refused while model_repository/ has no such model),
rounds interleaved in-process, Triton, ..., with the Triton path's ratios over in-process. Its prompt is
the same recording, P / 25 s long (P speech tokens), sent to the server as audio. `--decode-ahead both`
times the pipeline with the LLM waiting while token2wav runs and with the two overlapped, interleaved;
`--first-chunk both` times the overlapped pipeline with a stream's first chunk on token2wav's share of
the threads beside the LLM (shared) and alone on every core, the LLM waiting (alone, the default).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
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

from cosyvoice_triton.audio_out import SAMPLE_RATE
from cosyvoice_triton.family import family_of
from cosyvoice_triton.messages import SPEECH_TOKENS_PER_SECOND
from cosyvoice_triton.models.flow import FLOW_PRECISIONS
from cosyvoice_triton.models.llm_precision import LLM_PRECISIONS
from cosyvoice_triton.pipeline import audible
from cosyvoice_triton.pipeline.chunk_policy import CHUNK_PRESETS
from cosyvoice_triton.wire.names import TARGET_TEXT

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "official_driver.py"
# What the official import path needs in its own virtualenv (torch: the CPU build this project pins).
OFFICIAL_PACKAGES = ["torch==2.13.0", "transformers==4.51.3", "diffusers==0.29.0", "hyperpyyaml", "conformer",
                     "omegaconf", "hydra-core", "lightning", "einops", "librosa", "inflect", "onnxruntime",
                     "matplotlib", "rootutils", "rich", "gdown", "wget"]
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old green tree".split()


# ---- inputs --------------------------------------------------------------------------------------

def text_with_tokens(tokenize, tokens: int) -> str:
    """The shortest text of WORDS whose tokenization has at least `tokens` ids."""
    words: list[str] = [WORDS[0]]
    while len(tokenize(" ".join(words))) < tokens:
        words.append(WORDS[len(words) % len(WORDS)])
    return " ".join(words)


PROMPT_RATE = 16000
PROMPT_TEXT = "hello there"


def prompt_recording(prompt_tokens: int) -> np.ndarray:
    """A speech-like recording of exactly `prompt_tokens` speech tokens."""
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    return speech_like(prompt_tokens / SPEECH_TOKENS_PER_SECOND, PROMPT_RATE)


def make_inputs(tts, text_tokens: int, prompt_tokens: int):
    """(SynthesisRequest, the same request as arrays for the official side)."""
    from cosyvoice_triton.messages import SynthesisRequest

    voice = tts.encode_voice(prompt_recording(prompt_tokens), PROMPT_RATE, PROMPT_TEXT)
    tokens = np.asarray(voice.speech_tokens)[:prompt_tokens]
    voice = dataclasses.replace(voice, speech_tokens=tokens, mel=np.asarray(voice.mel)[:2 * len(tokens)])

    def sentences(text: str):  # the LLM requests the pipeline makes of `text` (normalized, split, tokenized)
        return tts.pipeline.llm_requests(SynthesisRequest(text=text, voice=voice, seed=1), "bench", 1)

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
                 llm_precision: str = "fp32", decode_ahead: bool = True, first_chunk_alone: bool = True,
                 flow_precision: str = "fp32", chunk_preset: str = "official", flow_rows: bool = True,
                 device: str = "cpu"):
        from cosyvoice_triton.models.flow_cache import FlowCacheSettings
        from cosyvoice_triton.perf.exact_length import exact_length
        from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice

        preset = CHUNK_PRESETS[chunk_preset]

        def load() -> CosyVoice:  # the folder's family (its yaml)
            tts = CosyVoice.from_model_dir(model_dir, device, llm_precision=llm_precision,
                                           flow_precision=flow_precision,
                                           flow_cache=FlowCacheSettings(cached_final=preset.cached_final))
            exact_length(tts.llm, speech_tokens)
            return tts

        self.load = load
        self.synths = [self.load()]
        self.decode_ahead = decode_ahead
        self.first_chunk_alone = first_chunk_alone
        self.flow_rows = flow_rows  # False: the flow's batched solver (models/flow_cache.py), the before
        self._map_rows = {}  # each synthesizer's own RowWorkers.map, kept while the batched solver runs
        self.request, self.arrays = make_inputs(self.synths[0], text_tokens, prompt_tokens)
        self.request = dataclasses.replace(self.request, chunk_policy=preset.policy())

    def round(self, concurrency: int) -> dict:
        while len(self.synths) < concurrency:
            self.synths.append(self.load())
        for tts in self.synths:
            tts.use_decode_ahead(self.decode_ahead)
            if self.decode_ahead:  # its CoreSharingToken2Wav
                tts.pipeline.token2wav.first_chunk_alone = self.first_chunk_alone
            map_rows = self._map_rows.setdefault(id(tts), tts.token2wav.map_rows)
            tts.token2wav.map_rows = map_rows if self.flow_rows else None
        return concurrent_round([lambda tts=tts: self._stream(tts) for tts in self.synths[:concurrency]])

    def _stream(self, tts) -> dict:
        return timed_stream(tts.synthesize(self.request, stream=True), tts.sample_rate)


class TritonSide:
    """Our side through a running tritonserver of the same folder (`perf.exact_length --exact-speech-tokens N`): c
    streams of the folder's family's streaming model (`served_model`) at once over gRPC, the same text.
    `voice`: "id", the recording registered once and named by its id (as production traffic does, and as the
    other sides are handed precomputed prompt features), or "audio", the recording sent with every request."""

    def __init__(self, url: str, model_dir: str, text_tokens: int, prompt_tokens: int, voice: str = "id"):
        from cosyvoice_triton.client import TritonTTS
        from cosyvoice_triton.preprocess.text import TextPreprocessor

        text = TextPreprocessor.from_model_dir(model_dir)  # as the server's cosyvoice2 model splits and encodes

        def tokens(words: str) -> list[int]:
            return text.tokenizer.encode(text.split(words, field=TARGET_TEXT)[0])

        self.text = text_with_tokens(tokens, text_tokens)
        self.prompt = prompt_recording(prompt_tokens)
        self.url = url
        self.clients: list = []
        self.make_client = functools.partial(TritonTTS, model=served_model(model_dir))
        self.voice = voice
        self.voice_id: str | None = None
        self.name = "triton" if voice == "id" else "triton_audio"

    def round(self, concurrency: int) -> dict:
        while len(self.clients) < concurrency:
            self.clients.append(self.make_client(self.url))
        if self.voice == "id" and self.voice_id is None:  # once, before any timed stream
            self.voice_id = self.clients[0].register_voice(self.prompt, sample_rate=PROMPT_RATE,
                                                           prompt_text=PROMPT_TEXT).voice_id
        return concurrent_round([lambda client=client: self._stream(client) for client in self.clients[:concurrency]])

    def _stream(self, client) -> dict:
        voice = {"voice_id": self.voice_id} if self.voice == "id" else \
            {"prompt_audio": self.prompt, "prompt_sample_rate": PROMPT_RATE, "prompt_text": PROMPT_TEXT}
        chunks = client.stream(self.text, seed=1, **voice)
        with chunks:
            return timed_stream(chunks, SAMPLE_RATE)

    def close(self) -> None:
        for client in self.clients:
            client.close()


def served_model(model_dir: str) -> str:
    """The streaming Triton model of the folder's family: the family's name (`cosyvoice2`), a model of
    model_repository/. A family with no such model there yet cannot be timed through tritonserver."""
    from cosyvoice_triton.server.launcher import DEFAULT_REPOSITORY

    family = family_of(model_dir)
    if not (DEFAULT_REPOSITORY / family.name).is_dir():
        raise SystemExit(f"--triton: {model_dir} holds a {family} model ({family.yaml_file}) and model_repository/ "
                         f"has no `{family.name}` model to serve it yet; time it in-process (without --triton)")
    return family.name


def timed_stream(chunks, sample_rate: int) -> dict:
    """First audio, first audible audio, total and audio seconds of one stream of chunks, timed from now."""
    start = time.perf_counter()
    first, samples, count = None, 0, 0
    heard = audible.AudibleDetector(sample_rate)
    for chunk in chunks:
        now = time.perf_counter() - start
        if chunk.size and first is None:
            first = now
        heard.feed(chunk, now)
        samples += chunk.size
        count += 1
    heard.finish()
    return {"first_s": first, "first_audible_s": heard.at, "total_s": time.perf_counter() - start,
            "audio_s": samples / sample_rate, "chunks": count}


def concurrent_round(streams: list) -> dict:
    """Run each stream function in a thread of its own, all at once; their results and the wall time. A
    stream that fails is recorded as {"error": ...} (the report counts it), so one failure never loses the
    rounds already run."""
    results: list[dict] = [{} for _ in streams]

    def run(index: int) -> None:
        try:
            results[index] = streams[index]()
        except Exception as exc:  # noqa: BLE001 - recorded, reported as a failed stream
            results[index] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(streams))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"streams": results, "wall_s": time.perf_counter() - start}


def serve_ours(args) -> None:
    """Worker mode: the line protocol of official_driver.py, for our side."""
    import torch

    torch.set_num_threads(args.threads)
    protocol, sys.stdout = sys.stdout, sys.stderr
    side = OurSide(args.model_dir, args.speech_tokens, args.text_tokens, args.prompt_tokens, args.llm_precision,
                   decode_ahead=args.decode_ahead != "off", first_chunk_alone=args.first_chunk != "shared",
                   flow_precision=args.flow_precision, chunk_preset=args.chunk_preset,
                   flow_rows=args.flow_rows != "off", device=args.device)
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
            "--llm-precision", args.llm_precision, "--flow-precision", args.flow_precision,
            "--chunk-preset", args.chunk_preset, "--device", args.device,
            "--decode-ahead", args.decode_ahead,
            "--first-chunk", args.first_chunk, "--flow-rows", args.flow_rows, "--write-inputs", str(inputs)]


def official_command(python: Path, args, inputs: Path) -> list[str]:
    return [str(python), str(DRIVER), "--official-src", str(args.official_src), "--model-dir", args.model_dir,
            "--inputs", str(inputs), "--speech-tokens", str(args.speech_tokens), "--threads", str(args.threads),
            "--audible-module", audible.__file__, "--device", args.device]


# ---- report ----------------------------------------------------------------------------------------

def summary(rounds: list[dict]) -> dict:
    """Medians over a side's rounds at one concurrency, of the streams that finished (`failed`: the others;
    NaN where none finished)."""
    done = [s for r in rounds for s in r["streams"] if "error" not in s]
    failed = sum("error" in s for r in rounds for s in r["streams"])
    if not done:
        return {key: float("nan") for key in ("first_audio_s", "first_audio_p90_s", "first_audible_s", "total_s",
                                              "audio_s_per_s", "audio_s")} | {"rounds": len(rounds), "failed": failed}
    firsts = [s["first_s"] for s in done]
    audibles = [s["first_audible_s"] for s in done if s.get("first_audible_s") is not None]  # none: all silent
    return {"first_audio_s": statistics.median(firsts),
            "first_audio_p90_s": float(np.percentile(firsts, 90)),
            "first_audible_s": statistics.median(audibles) if audibles else float("nan"),
            "total_s": statistics.median(s["total_s"] for s in done),
            "audio_s_per_s": statistics.median(sum(s.get("audio_s", 0.0) for s in r["streams"]) / r["wall_s"]
                                               for r in rounds),
            "audio_s": done[0]["audio_s"], "rounds": len(rounds), "failed": failed}


ROWS = [("first audio (median)", "first_audio_s", "s"), ("first audio p90", "first_audio_p90_s", "s"),
        ("first audible audio (median)", "first_audible_s", "s"),
        ("total per stream (median)", "total_s", "s"), ("audio seconds per second", "audio_s_per_s", "")]


def markdown(result: dict) -> str:
    meta = result["meta"]
    served = [name for name in SERVED if name in result["levels"][0]]
    on_gpu = f", {meta['device']}" if meta.get("device", "cpu") != "cpu" else ""
    lines = [f"{meta.get('family', 'cosyvoice2')}; {meta['date']}; {meta['cpu']}{on_gpu}; "
             f"torch {meta['torch_ours']} (ours) / {meta['torch_official']} (official), "
             f"{meta['threads']} threads each; {meta['text_tokens']} text tokens, {meta['prompt_tokens']}-token prompt, "
             f"exactly {meta['speech_tokens']} speech tokens; LLM {meta['llm_precision']}, flow {meta.get('flow_precision', 'fp32')} "
             f"({meta.get('cpu_kind', 'CPU kind not recorded')}), chunk preset {meta.get('chunk_preset', 'official')}; "
             f"load average "
             f"{meta['load_min']:.1f}-{meta['load_max']:.1f} over the rounds", "",
             "| c | | official | ours in-process | / official |" + "".join(f" {SERVED_LABELS[name]} | / official |"
                                                                       for name in served),
             "|---:|---|---:|---:|---:|" + "---:|---:|" * len(served)]
    for level in result["levels"]:
        official = level["official"]
        for label, key, unit in ROWS:
            cells = [f"{_cell(level[name].get(key), unit)} | {_cell(level[name].get(key, NAN) / official.get(key, NAN))}"
                     for name in ["ours", *served]]
            lines.append(f"| {level['concurrency']} | {label} | {_cell(official.get(key), unit)} | " + " | ".join(cells)
                         + " |")
    failures = [f"c = {level['concurrency']} {name}: {level[name]['failed']}" for level in result["levels"]
                for name in ["official", "ours", *served] if level[name].get("failed")]
    if failures:
        lines += ["", "Streams that failed (not in the medians): " + "; ".join(failures)]
    return "\n".join(lines) + "\n"


NAN = float("nan")


def _cell(value: float | None, unit: str = "") -> str:
    """A table cell: '-' where a side has no figure (a silent stream's first audible audio, older rounds)."""
    return "-" if value is None or np.isnan(value) else f"{value:.2f}{unit}"


SERVED_LABELS = {"triton": "through tritonserver (voice id)", "triton_audio": "through tritonserver (prompt as audio)"}


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
    sides = [official, ours] + served_sides(args)
    rounds: dict[tuple[int, str], list[dict]] = {}
    loads: list[float] = []
    try:
        for _ in range(args.repeats):
            for level in args.concurrency:
                for side in sides:  # A, B, C, A, B, C: every side sees the same load on the machine
                    loads.append(os.getloadavg()[0])
                    result = side.round(level)
                    result["load_average"] = loads[-1]
                    rounds.setdefault((level, side.name), []).append(result)
                    print(f"c={level} {side.name}: wall {result['wall_s']:.1f} s, load {loads[-1]:.1f}", file=sys.stderr)
    finally:
        for side in sides:
            side.close()
    meta = {"family": family_of(args.model_dir).name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": cpu_name(), "torch_ours": ours.hello["torch"], "torch_official": official.hello["torch"],
            "threads": args.threads,
            "text_tokens": len(np.load(inputs)["text_tokens"]), "prompt_tokens": args.prompt_tokens,
            "speech_tokens": args.speech_tokens, **precisions(args),
            "decode_ahead": args.decode_ahead != "off", "load_min": min(loads),
            "load_max": max(loads), "model_dir": args.model_dir}
    return write_report(out, meta, args.concurrency, rounds)


def served_sides(args) -> list:
    """With --triton: the served path as two more sides, the voice by id and the prompt as audio."""
    if not args.triton:
        return []
    return [TritonSide(args.triton, args.model_dir, args.text_tokens, args.prompt_tokens, voice) for voice in ("id", "audio")]


SERVED = ("triton", "triton_audio")  # the served sides' names, in the report's column order


def write_report(out: Path, meta: dict, levels: list[int], rounds: dict[tuple[int, str], list[dict]]) -> dict:
    """side_by_side.json and side_by_side.md under `out` from each (level, side)'s rounds."""
    result = {"meta": meta,
              "levels": [{"concurrency": level, "official": summary(rounds[(level, "official")]),
                          "ours": summary(rounds[(level, "our")]),
                          **{name: summary(rounds[(level, name)]) for name in SERVED if (level, name) in rounds}}
                         for level in levels],
              "rounds": {f"c{level}_{name}": r for (level, name), r in rounds.items()}}
    (out / "side_by_side.json").write_text(json.dumps(result, indent=1))
    (out / "side_by_side.md").write_text(markdown(result))
    return result


def precisions(args) -> dict:
    """Our side's precisions as run (`auto` resolved on this machine), for the report."""
    from cosyvoice_triton.models.auto_precision import describe_cpu, resolve_flow_precision, resolve_llm_precision

    return {"llm_precision": resolve_llm_precision(args.llm_precision, args.device),
            "flow_precision": resolve_flow_precision(args.flow_precision, args.device), "cpu_kind": describe_cpu(),
            "chunk_preset": args.chunk_preset, "device": device_name(args.device)}


def device_name(device: str) -> str:
    """Where the sides ran, for the report: "cpu", or the GPU by name."""
    import torch

    if torch.device(device).type != "cuda":
        return "cpu"
    return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"


def our_variants(args) -> tuple[OurSide, list[tuple[str, object]]]:
    """Our in-process side, and (name, round function of a concurrency) of each way our side is timed, in
    the order they alternate."""
    side = OurSide(args.model_dir, args.speech_tokens, args.text_tokens, args.prompt_tokens, args.llm_precision,
                   decode_ahead=args.decode_ahead != "off", first_chunk_alone=args.first_chunk != "shared",
                   flow_precision=args.flow_precision, chunk_preset=args.chunk_preset,
                   flow_rows=args.flow_rows != "off", device=args.device)

    def in_process(decode_ahead: bool, first_chunk_alone: bool = args.first_chunk != "shared",
                   flow_rows: bool = args.flow_rows != "off"):
        def run(concurrency: int) -> dict:
            side.decode_ahead, side.first_chunk_alone, side.flow_rows = decode_ahead, first_chunk_alone, flow_rows
            return side.round(concurrency)
        return run

    variants = [("in_process", in_process(args.decode_ahead != "off"))]
    if args.first_chunk == "both":
        variants.insert(0, ("in_process_first_chunk_shared", in_process(args.decode_ahead != "off", False)))
    if args.decode_ahead == "both":
        variants.insert(0, ("in_process_llm_waits", in_process(False)))
    if args.flow_rows == "both":
        variants.insert(0, ("in_process_flow_batched", in_process(args.decode_ahead != "off", flow_rows=False)))
    for served in served_sides(args):
        variants.append((served.name, served.round))
    return side, variants


RATIOS = [("triton", "in_process"), ("triton_audio", "in_process"),  # (variant, the peer it is divided by)
          ("in_process", "in_process_llm_waits"),
          ("in_process", "in_process_first_chunk_shared"),
          ("in_process", "in_process_flow_batched")]


def ours_alone(args) -> dict:
    """The public timing entry: our side alone, in-process (and through Triton with --triton), rounds of
    every variant interleaved at each concurrency level, each with its load average."""
    import torch

    torch.set_num_threads(args.threads)
    side, variants = our_variants(args)
    levels = []
    for level in args.concurrency:
        rounds: dict[str, list[dict]] = {name: [] for name, _ in variants}
        for _ in range(args.repeats):
            for name, run in variants:  # A, B, A, B: every variant sees the machine's load alike
                load = os.getloadavg()[0]
                result = run(level)
                result["load_average"] = load
                rounds[name].append(result)
                print(f"c={level} {name}: wall {result['wall_s']:.1f} s, load {load:.1f}", file=sys.stderr)
        summaries = {name: {**summary(r), "load_average": [x["load_average"] for x in r]} for name, r in rounds.items()}
        ratios = {f"{name} / {peer}": {key: summaries[name][key] / summaries[peer][key]
                                       for key in ("first_audio_s", "first_audible_s", "total_s", "audio_s_per_s")}
                  for name, peer in RATIOS if name in summaries and peer in summaries}
        levels.append({"concurrency": level, "load_average": summaries["in_process"]["load_average"][0],
                       **summaries["in_process"], "variants": summaries, "ratios": ratios})
    return {"family": side.synths[0].family.name, "speech_tokens": args.speech_tokens,
            "text_tokens": len(side.arrays["text_tokens"]),
            "prompt_tokens": len(side.arrays["prompt_speech_tokens"]), **precisions(args),
            "decode_ahead": args.decode_ahead, "first_chunk": args.first_chunk, "flow_rows": args.flow_rows,
            "triton": args.triton,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "threads": args.threads, "cpu": cpu_name(), "levels": levels}


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """The setting our side runs in (also perf/stream_profile.py's): folder, token counts, threads, precision."""
    parser.add_argument("--model-dir", required=True, help="the model folder both sides load")
    parser.add_argument("--speech-tokens", type=int, default=250, help="exactly N speech tokens per stream")
    parser.add_argument("--text-tokens", type=int, default=40, help="at least T text tokens")
    parser.add_argument("--prompt-tokens", type=int, default=75, help="a prompt of P speech tokens")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side")
    parser.add_argument("--llm-precision", default="auto", choices=[*LLM_PRECISIONS, "auto"],
                        help="our LLM's (as serve's; auto: from the CPU's instructions, models/auto_precision.py)")
    parser.add_argument("--flow-precision", default="auto", choices=[*FLOW_PRECISIONS, "auto"],
                        help="our torch flow estimator's (as serve's)")
    parser.add_argument("--device", default="cpu",
                        help="torch device of both sides (the official code takes the GPU whenever torch sees one, "
                             "so with cpu its driver hides it)")
    parser.add_argument("--chunk-preset", default="official", choices=list(CHUNK_PRESETS),
                        help="our in-process side's chunk preset (a served side: the server's, serve --chunk-preset)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_setting_arguments(parser)
    parser.add_argument("--official-src", type=Path, help="checkout of the official repository (with "
                                                          "third_party/Matcha-TTS); without it, our side alone")
    parser.add_argument("--official-venv", type=Path, help="its virtualenv (default: made under a temp folder)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4],
                        help="streams at once, one run per level (default 1 4)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds; each runs every level on every side, interleaved (default 2)")
    parser.add_argument("--decode-ahead", default="on", choices=["on", "off", "both"],
                        help="our pipeline's LLM decodes while token2wav runs (on), waits for it (off), or both, "
                             "interleaved (our side alone)")
    parser.add_argument("--first-chunk", default="alone", choices=["alone", "shared", "both"],
                        help="with decode-ahead, a stream's first chunk runs alone on every core while the LLM "
                             "waits (alone), on token2wav's share beside the LLM (shared), or both, interleaved "
                             "(our side alone)")
    parser.add_argument("--flow-rows", default="on", choices=["on", "off", "both"],
                        help="our torch flow solves each stream's guidance halves as rows spread over the free "
                             "cores (on), or as one batch per Euler step (off, the before), or both, interleaved "
                             "(our side alone)")
    parser.add_argument("--triton", metavar="HOST:PORT", default=None,
                        help="our side alone: also time a running tritonserver of the same folder over gRPC "
                             "(started with python -m cosyvoice_triton.perf.exact_length --exact-speech-tokens N), "
                             "interleaved with in-process")
    parser.add_argument("--out", default="bench_official_out",
                        help="folder of the report and the raw timings (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="our side alone: print its JSON on one line")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write-inputs", type=Path, help=argparse.SUPPRESS)


def run(args) -> int:
    if args.triton:
        served_model(args.model_dir)  # refused before any side starts
    if args.worker:
        serve_ours(args)
    elif args.official_src is None:
        result = ours_alone(args)
        print(json.dumps(result, indent=None if args.json else 1))
    else:
        print(markdown(side_by_side(args)))
    return 0


def add_command(sub) -> None:
    """`cosyvoice-triton bench-official` (an entry point of the cosyvoice_triton.commands group)."""
    p = sub.add_parser("bench-official", help="time our pipeline side by side with the official CosyVoice2 or "
                                              "CosyVoice3 code (the folder's family) "
                                              "(or our side alone: in-process, through Triton)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
