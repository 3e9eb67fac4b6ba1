"""Compiled hot loops (models/compiled.py) against eager: compile time, cold and warm, and the time per call.

For each module, two fresh processes share one new inductor cache folder: the first compiles cold, the
second warm (the FX-graph cache on disk from the first). Each then times the module's hot call eager and
compiled, interleaved in the same process, and reports medians:
- flow: one estimator call (the flow's Euler step) over one chunk's rows (2: guidance), `--frames` frames;
- llm: one decode step of `--rows` rows at position `--position`;
- hift: one vocoder call over `--frames` mel frames.

    python -m cosyvoice_triton.perf.compile_bench --model-dir FULL_MODEL --threads 2 --repeats 7

(FULL_MODEL: a model folder, e.g. one written by `cosyvoice-triton export --size full`.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODULES = ("flow", "llm", "hift")


def hot_call(module: str, model_dir: str, args: argparse.Namespace):
    """(the model, a no-argument call of its hot loop)."""
    import torch

    g = torch.Generator().manual_seed(0)
    if module == "flow":
        from cosyvoice_triton.models.flow import FlowModel
        flow = FlowModel.from_model_dir(model_dir)
        est, B, T = flow.decoder.estimator, 2, args.frames
        x, mu, cond = (torch.randn(B, 80, T, generator=g) for _ in range(3))
        inputs = (x, torch.ones(B, 1, T), mu, torch.full((B,), 0.3), torch.randn(B, 80, generator=g), cond,
                  torch.ones(B, dtype=torch.bool))
        return flow, lambda: est(*inputs)
    if module == "llm":
        from cosyvoice_triton.models.speech_lm import SpeechLM
        from cosyvoice_triton.models.qwen2 import kv_bucket
        llm = SpeechLM.from_model_dir(model_dir, max_batch=max(args.rows, 1), max_seq_len=2048,
                                      precision=args.llm_precision)
        B = args.rows
        tokens = torch.randint(0, llm.config.speech_token_size, (B, 1), generator=g)
        input_pos, slots = torch.full((B, 1), args.position), torch.arange(B)
        kv_len = kv_bucket(args.position + 1, llm.max_seq_len)
        return llm, lambda: llm.step_logits(llm.embed_speech(tokens), input_pos, slots, kv_len)
    from cosyvoice_triton.models.hift import HiFTGenerator
    from cosyvoice_triton.models.hift_source import ZeroNoise
    hift = HiFTGenerator.from_model_dir(model_dir)
    mel = torch.randn(1, 80, args.frames, generator=g)
    return hift, lambda: hift.inference(mel, None, ZeroNoise())


def worker(args: argparse.Namespace) -> dict:
    """One process: compile (`apply_compile` and its warm-up), then eager and compiled calls interleaved."""
    import torch
    from cosyvoice_triton.models import compiled

    torch.set_num_threads(args.threads)
    model, call = hot_call(args.worker, args.model_dir, args)
    with torch.inference_mode():
        call()  # eager warm-up
        start = time.perf_counter()
        done = compiled.apply_compile("on", "cpu", **{args.worker: model})  # compiles: its warm-up
        compile_s = time.perf_counter() - start
        out_c = _first(call())
        _route(model, args.worker, False)
        max_abs = float((_first(call()) - out_c).abs().max())  # after the warm-up, which writes the LLM's cache
        eager, comp = [], []
        for _ in range(args.repeats):
            for on, times in ((False, eager), (True, comp)):
                _route(model, args.worker, on)
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
    return {"module": args.worker, "compiled": list(done), "compile_s": compile_s,
            "graphs": compiled.graphs(), "eager_s": statistics.median(eager), "compiled_s": statistics.median(comp),
            "speedup": statistics.median(eager) / statistics.median(comp), "max_abs_diff": max_abs,
            "load": os.getloadavg()}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _route(model, module: str, on: bool) -> None:
    """Send the compiled blocks' calls through the compiled forward (on) or the class's (off)."""
    from cosyvoice_triton.models import compiled
    if on:
        compiled.apply_compile("on", "cpu", **{module: model}, warm_up=False)
        return
    for block in model.modules():
        block.__dict__.pop("forward", None)
        block.__dict__.pop("forward_cached", None)


def run_module(module: str, args: argparse.Namespace) -> list[dict]:
    """A cold and a warm process for `module`, sharing a new cache folder."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        rows = []
        for _ in ("cold", "warm"):
            cmd = [sys.executable, "-m", "cosyvoice_triton.perf.compile_bench", "--worker", module,
                   "--model-dir", args.model_dir, "--threads", str(args.threads), "--repeats", str(args.repeats),
                   "--frames", str(args.frames), "--rows", str(args.rows), "--position", str(args.position),
                   "--llm-precision", args.llm_precision]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--modules", nargs="+", choices=MODULES, default=list(MODULES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--frames", type=int, default=200, help="flow: estimator frames; hift: mel frames")
    p.add_argument("--rows", type=int, default=1, help="llm: streams decoded together")
    p.add_argument("--position", type=int, default=200, help="llm: the decoded position")
    p.add_argument("--llm-precision", default="fp32")
    p.add_argument("--worker", choices=MODULES, help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    rows = []
    for module in args.modules:
        cold, warm = run_module(module, args)
        rows.append({**cold, "warm_compile_s": warm["compile_s"], "warm_speedup": warm["speedup"]})
        r = rows[-1]
        print(f"{module}: compile cold {r['compile_s']:.1f} s, warm {r['warm_compile_s']:.1f} s; per call eager "
              f"{r['eager_s'] * 1e3:.1f} ms, compiled {r['compiled_s'] * 1e3:.1f} ms ({r['speedup']:.2f}x; warm "
              f"process {r['warm_speedup']:.2f}x); max |diff| {r['max_abs_diff']:.1e}; graphs {r['graphs']}; "
              f"load {r['load'][0]:.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
