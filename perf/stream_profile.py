"""Where the time of our in-process streams goes: a timeline of their stages.

    python -m cosyvoice_triton.perf.stream_profile --model-dir DIR [--speech-tokens 250] [--text-tokens 40] \
        [--prompt-tokens 75] [--threads 2] [--llm-precision fp32] [--device cpu] [--concurrency 1] \
        [--warmup 1] [--json FILE]

Runs our side exactly as perf/bench_official.py does (its `OurSide` and `make_inputs`: exactly N speech
tokens, the LLM decoding ahead, a stream's first chunk alone on every core, the per-stream flow cache and
the prompt flow cache), `--warmup` unprofiled rounds first (the first fills the prompt flow cache, as a
registered voice's later requests find it), then one profiled round. For that round only, the calls of
each synthesizer's stages are wrapped on their objects (restored afterwards) and timed with
`time.perf_counter`, each recorded as (stage, stream, start, end, thread, details):

- `prefill`, `decode`: `SpeechLM.step_logits` (a call over more than one position is the prefill; one
  call per step, however many rows it batches: `batch` says how many; sampling a token from the logits
  and embedding it are outside, in "no stage ran");
- `flow`: `Token2Wav.mel`, one call per chunk (the tokens so far and the new ones, i.e. those of the
  enclosing token2wav call; emitted / cached / prompt frames and all frames of the call, of which the
  computed ones are those not cached; whether it is the final full-attention pass);
- `hift`: the vocoder's `inference` (mel frames in, samples out), and CosyVoice3's windowed call
  `inference_window` (token2wav/causal_vocoder_stream.py: the window's frames in);
- `token2wav`: the token2wav stage's `chunk` (flow + HiFT + waiting for the core share);
- `emit`: a chunk reaching the caller (start = end).

Prints a markdown report (first audio: its wall time and what ran before it; the whole stream: busy
time per stage, every flow call, the LLM's decode steps, how much the LLM and token2wav overlapped, each
stage's share of the wall time) with the load average at the start and end; `--json FILE` writes the
same numbers and the timeline.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from cosyvoice_triton.perf.bench_official import OurSide, add_setting_arguments, precisions

COMPUTE = ("prefill", "decode", "flow", "hift")  # the stages that run models
LLM = ("prefill", "decode")


@dataclass
class Event:
    stage: str
    stream: int
    start: float  # time.perf_counter()
    end: float
    thread: str
    details: dict = field(default_factory=dict)


class Timeline:
    """The events of one profiled round, from any thread."""

    def __init__(self):
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def add(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, stream: int, *stages: str) -> list[Event]:
        return [e for e in self.events if e.stream == stream and e.stage in stages]


# ---- wrapping the stages ---------------------------------------------------------------------------

def wrap(obj, name: str, timeline: Timeline, stream: int, describe) -> Callable[[], None]:
    """Time every call of `obj.name` (set on the instance); returns the function that restores it.

    describe(arguments, before) -> (stage, details) is called twice: with before=True ahead of the call
    (result None) for what the call changes, then with the result."""
    previous = vars(obj).get(name)
    original = getattr(obj, name)
    signature = inspect.signature(original)

    def timed(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        _, before = describe(arguments, None)
        threads = torch.get_num_threads()
        start = time.perf_counter()
        result = original(*args, **kwargs)
        end = time.perf_counter()
        stage, details = describe(arguments, result)
        timeline.add(Event(stage, stream, start, end, threading.current_thread().name,
                           {**before, **details, "threads": threads}))
        return result

    setattr(obj, name, timed)

    def restore() -> None:
        if previous is None:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)
    return restore


def describe_llm_step(arguments: dict, result) -> tuple[str, dict]:
    x = arguments["x"]  # (B, L, D)
    stage = "prefill" if x.shape[1] > 1 else "decode"
    return stage, {"batch": int(x.shape[0]), "positions": int(x.shape[1]), "kv_len": arguments.get("kv_len")}


def describe_flow(ratio: int):
    def describe(arguments: dict, result) -> tuple[str, dict]:
        tokens, offset, prompt = arguments["tokens"], arguments["token_offset"], arguments["prompt"]
        streaming, cache = arguments["streaming"], arguments.get("cache")
        if result is None:  # before the call: the frames the stream's cache already holds
            usable = cache is not None and streaming and cache.steps
            return "flow", {"cached_frames": int(cache.frames) if usable else 0}
        prompt_frames, frames = int(prompt.mel.shape[1]), int(result.shape[2])
        return "flow", {"tokens": int(tokens.shape[1]), "token_offset": int(offset), "frames": frames,
                        "prompt_frames": prompt_frames, "all_frames": prompt_frames + ratio * int(offset) + frames,
                        "final": bool(arguments["finalize"]), "full_attention": not streaming}
    return describe


def describe_hift(arguments: dict, result) -> tuple[str, dict]:
    samples = {} if result is None else {"samples": int(result[0].shape[-1])}
    return "hift", {"mel_frames": int(arguments["mel"].shape[2]), **samples}


def describe_token2wav(arguments: dict, result) -> tuple[str, dict]:
    chunk = arguments["chunk"]
    return "token2wav", {"tokens": len(chunk.tokens), "final": chunk.finalize, "first": chunk.prompt is not None}


@contextmanager
def profiling(tts, stream: int, timeline: Timeline):
    """Time the stages of synthesizer `tts` (one `CosyVoice2`) as stream `stream` while inside."""
    token2wav = tts.token2wav
    vocoder_calls = [name for name in ("inference", "inference_window") if hasattr(token2wav.hift, name)]
    restores = [wrap(tts.llm, "step_logits", timeline, stream, describe_llm_step),
                wrap(token2wav, "mel", timeline, stream, describe_flow(token2wav.token_mel_ratio)),
                *(wrap(token2wav.hift, name, timeline, stream, describe_hift) for name in vocoder_calls),
                wrap(tts.pipeline.token2wav, "chunk", timeline, stream, describe_token2wav)]
    try:
        yield
    finally:
        for restore in reversed(restores):
            restore()


class ProfiledSide(OurSide):
    """bench_official's in-process side; while `timeline` is set, its streams are profiled into it and
    their chunks kept in `chunks` (one list per stream)."""

    timeline: Timeline | None = None

    def profiled_round(self, concurrency: int) -> tuple[Timeline, dict]:
        self.timeline, self.chunks = Timeline(), {}
        try:
            return self.timeline, self.round(concurrency)
        finally:
            self.timeline = None

    def _stream(self, tts) -> dict:
        if self.timeline is None:
            return super()._stream(tts)
        stream, timeline, chunks = self.synths.index(tts), self.timeline, []
        with profiling(tts, stream, timeline):  # round() has set the stages up: wrap them now
            start = time.perf_counter()
            for chunk in tts.synthesize(self.request, stream=True):
                now = time.perf_counter()
                timeline.add(Event("emit", stream, now, now, threading.current_thread().name,
                                   {"samples": int(chunk.size)}))
                chunks.append(chunk)
            end = time.perf_counter()
        self.chunks[stream] = chunks
        return {"stream": stream, "start": start, "end": end, "chunks": len(chunks),
                "audio_s": sum(c.size for c in chunks) / tts.sample_rate}


# ---- the report --------------------------------------------------------------------------------------

def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in union(intervals))


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time both sets of intervals cover."""
    a, b = union(a), union(b)
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def spans(events: list[Event]) -> list[tuple[float, float]]:
    return [(e.start, e.end) for e in events]


def first_audio(timeline: Timeline, stream: dict) -> dict:
    """Stream `stream`'s first audio: its wall time and what its stages did before it (events that ended
    by then), in seconds from the stream's start."""
    index, start = stream["stream"], stream["start"]
    first = next(e.end for e in timeline.of(index, "emit") if e.details["samples"])
    before = [e for e in timeline.of(index, *COMPUTE) if e.end <= first]
    decode = [e for e in before if e.stage == "decode"]
    prefill = [e for e in before if e.stage == "prefill"]
    return {"stream": index, "first_audio_s": first - start,
            "before_prefill_s": (prefill[0].start - start) if prefill else None,
            "prefill_s": length(spans(prefill)),
            "decode_steps": len(decode), "decode_s": length(spans(decode)),
            "decode_mean_ms": 1e3 * statistics.mean(e.end - e.start for e in decode) if decode else None,
            "flow_calls": sum(e.stage == "flow" for e in before),
            "flow_s": length(spans([e for e in before if e.stage == "flow"])),
            "hift_calls": sum(e.stage == "hift" for e in before),
            "hift_s": length(spans([e for e in before if e.stage == "hift"])),
            "no_stage_s": (first - start) - length(spans(before))}


def enclosing(event: Event, outer: list[Event]) -> Event:
    """The event of `outer` (the token2wav stage's chunk calls) that `event` ran inside."""
    return next(o for o in outer if o.stream == event.stream and o.start <= event.start and event.end <= o.end)


def whole_stream(timeline: Timeline, streams: list[dict]) -> dict:
    """The round: wall time, busy time per stage (union over streams), each flow call, the decode steps,
    the LLM / token2wav overlap and each stage's share of the wall time."""
    start, end = min(s["start"] for s in streams), max(s["end"] for s in streams)
    wall = end - start
    events = timeline.events
    by_stage = {stage: [e for e in events if e.stage == stage] for stage in (*COMPUTE, "token2wav")}
    busy = {stage: length(spans(by_stage[stage])) for stage in by_stage}
    llm = spans(by_stage["prefill"] + by_stage["decode"])
    decode = by_stage["decode"]
    decode_threads = {}
    for threads in sorted({e.details["threads"] for e in decode}):
        steps = [e.end - e.start for e in decode if e.details["threads"] == threads]
        decode_threads[str(threads)] = {"steps": len(steps), "mean_ms": 1e3 * statistics.mean(steps)}
    origin = {s["stream"]: s["start"] for s in streams}
    flow_calls = [{"stream": e.stream, "at_s": e.start - origin[e.stream], "s": e.end - e.start,
                   "new_tokens": enclosing(e, by_stage["token2wav"]).details["tokens"], **e.details}
                  for e in sorted(by_stage["flow"], key=lambda e: (e.stream, e.start))]
    hift_calls = [{"stream": e.stream, "at_s": e.start - origin[e.stream], "s": e.end - e.start, **e.details}
                  for e in sorted(by_stage["hift"], key=lambda e: (e.stream, e.start))]
    return {"wall_s": wall, "busy_s": busy, "calls": {stage: len(by_stage[stage]) for stage in by_stage},
            "share_of_wall": {stage: busy[stage] / wall for stage in COMPUTE},
            "llm_busy_s": length(llm), "token2wav_compute_s": length(spans(by_stage["flow"] + by_stage["hift"])),
            "llm_flow_overlap_s": overlap(llm, spans(by_stage["flow"])),
            "llm_hift_overlap_s": overlap(llm, spans(by_stage["hift"])),
            "no_stage_s": wall - length(spans([e for e in events if e.stage in COMPUTE])),
            "decode_steps": len(decode), "decode_s": sum(e.end - e.start for e in decode),
            "decode_mean_ms": 1e3 * statistics.mean(e.end - e.start for e in decode) if decode else None,
            "decode_by_threads": decode_threads, "flow_calls": flow_calls, "hift_calls": hift_calls,
            "chunks": sum(s["chunks"] for s in streams), "audio_s": sum(s["audio_s"] for s in streams)}


def profile(args) -> dict:
    torch.set_num_threads(args.threads)
    side = ProfiledSide(args.model_dir, args.speech_tokens, args.text_tokens, args.prompt_tokens, args.llm_precision,
                        flow_precision=args.flow_precision, chunk_preset=args.chunk_preset, device=args.device)
    for _ in range(args.warmup):
        side.round(args.concurrency)
    load_start = os.getloadavg()
    timeline, result = side.profiled_round(args.concurrency)
    load_end = os.getloadavg()
    streams = result["streams"]
    origin = min(s["start"] for s in streams)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model_dir": args.model_dir,
            "speech_tokens": args.speech_tokens, "text_tokens": len(side.arrays["text_tokens"]),
            "prompt_tokens": len(side.arrays["prompt_speech_tokens"]), "threads": args.threads,
            **precisions(args), "concurrency": args.concurrency, "warmup_rounds": args.warmup,
            "torch": torch.__version__, "load_average_start": load_start[0], "load_average_end": load_end[0],
            "first_audio": [first_audio(timeline, s) for s in streams], "whole": whole_stream(timeline, streams),
            "timeline": [{**asdict(e), "start": e.start - origin, "end": e.end - origin} for e in timeline.events]}


def markdown(report: dict) -> str:
    whole = report["whole"]
    lines = [f"{report['date']}; {report['model_dir']}; {report['text_tokens']} text tokens, "
             f"{report['prompt_tokens']}-token prompt, exactly {report['speech_tokens']} speech tokens, "
             f"c = {report['concurrency']}, {report['threads']} torch threads, LLM {report['llm_precision']}, "
             f"flow {report['flow_precision']}, on {report['device']}, "
             f"{report['warmup_rounds']} warm-up round(s); load average {report['load_average_start']:.2f} at the "
             f"start, {report['load_average_end']:.2f} at the end", "",
             "First audio (what ran before it, in the stream's own stages):", "",
             "| stream | first audio | before prefill | prefill | decode steps (mean) | flow calls | HiFT calls "
             "| no stage ran |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for f in report["first_audio"]:
        mean = f"{f['decode_mean_ms']:.1f} ms" if f["decode_mean_ms"] is not None else "-"
        before = f"{f['before_prefill_s']:.2f} s" if f["before_prefill_s"] is not None else "-"
        lines.append(f"| {f['stream']} | {f['first_audio_s']:.2f} s | {before} | {f['prefill_s']:.2f} s | "
                     f"{f['decode_steps']}: {f['decode_s']:.2f} s ({mean}) | {f['flow_calls']}: {f['flow_s']:.2f} s | "
                     f"{f['hift_calls']}: {f['hift_s']:.2f} s | {f['no_stage_s']:.2f} s |")
    wall = whole["wall_s"]
    lines += ["", f"Whole stream: wall {wall:.2f} s, {whole['chunks']} chunks, {whole['audio_s']:.2f} s of audio.", "",
              "| stage | calls | busy | share of wall |", "|---|---:|---:|---:|"]
    for stage in COMPUTE:
        lines.append(f"| {stage} | {whole['calls'][stage]} | {whole['busy_s'][stage]:.2f} s | "
                     f"{whole['share_of_wall'][stage]:.2f} |")
    lines += [f"| LLM (prefill + decode) | | {whole['llm_busy_s']:.2f} s | {whole['llm_busy_s'] / wall:.2f} |",
              f"| token2wav (flow + HiFT) | | {whole['token2wav_compute_s']:.2f} s | "
              f"{whole['token2wav_compute_s'] / wall:.2f} |",
              f"| token2wav stage calls (with core-share waits) | {whole['calls']['token2wav']} | "
              f"{whole['busy_s']['token2wav']:.2f} s | {whole['busy_s']['token2wav'] / wall:.2f} |",
              f"| LLM and flow at once | | {whole['llm_flow_overlap_s']:.2f} s | {whole['llm_flow_overlap_s'] / wall:.2f} |",
              f"| LLM and HiFT at once | | {whole['llm_hift_overlap_s']:.2f} s | {whole['llm_hift_overlap_s'] / wall:.2f} |",
              f"| no stage ran | | {whole['no_stage_s']:.2f} s | {whole['no_stage_s'] / wall:.2f} |", ""]
    mean = f"{whole['decode_mean_ms']:.1f} ms" if whole["decode_mean_ms"] is not None else "-"
    by_threads = ", ".join(f"{d['steps']} on {t} thread(s) {d['mean_ms']:.1f} ms"
                           for t, d in whole["decode_by_threads"].items())
    lines += [f"LLM decode steps: {whole['decode_steps']}, {whole['decode_s']:.2f} s in all, mean {mean} "
              f"({by_threads}).", "",
              "| stream | flow call at | new tokens | emitted frames | prompt frames | cached frames | computed frames "
              "| full attention | threads | time |", "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for c in whole["flow_calls"]:
        lines.append(f"| {c['stream']} | {c['at_s']:.2f} s | {c['new_tokens']} | {c['frames']} | {c['prompt_frames']} | "
                     f"{c['cached_frames']} | {c['all_frames'] - c['cached_frames']} | "
                     f"{'yes' if c['full_attention'] else 'no'} | {c['threads']} | {c['s']:.2f} s |")
    lines += ["", "| stream | HiFT call at | mel frames | threads | time |", "|---:|---:|---:|---:|---:|"]
    for c in whole["hift_calls"]:
        lines.append(f"| {c['stream']} | {c['at_s']:.2f} s | {c['mel_frames']} | {c['threads']} | {c['s']:.2f} s |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_setting_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=1, help="streams at once (one synthesizer each)")
    parser.add_argument("--warmup", type=int, default=1, help="unprofiled rounds first (the first fills the "
                                                               "prompt flow cache)")
    parser.add_argument("--json", metavar="FILE", help="also write the report and the timeline as JSON")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    report = profile(args)
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    return report


if __name__ == "__main__":
    main()
