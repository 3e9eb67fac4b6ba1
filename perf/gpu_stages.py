"""The per-family parts of a GPU run (perf/gpu_bench.py) after its levels, outside its time budget.

- Where one stream's time goes on the device: perf/stream_profile.py's report of one stream of exactly N
  speech tokens after a warm-up round (first audio and what ran before it; every LLM prefill and decode step,
  flow call and vocoder call), on the family's folder.
- With `--official-src` and `--official-venv`: perf/bench_official.py's side by side with the official code on
  the same folder, both sides on the device (the official model class takes the GPU whenever torch sees one),
  c streams at once, rounds interleaved; its side_by_side.md / .json also go to `<out>/official-<family>/`.

Both use the results page's lengths (250 speech tokens, 40 text tokens, a 75-token prompt; `--quick`: 30 /
6 / 20) and `auto` precisions (on a GPU: LLM and flow estimator bf16; the official side fp32). Each part
returns one section of the report, {"title", "markdown"}; a part that fails says why in its place and the
run goes on.
"""
from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Callable

import torch

from cosyvoice_triton.perf import bench_official, stream_profile

LENGTHS = {"full": (250, 40, 75), "quick": (30, 6, 20)}  # (speech, text, prompt tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage-profile", choices=["on", "off"], default="on",
                        help="after each family's levels, where one stream's time goes on the device "
                             "(perf/stream_profile.py; default on)")
    parser.add_argument("--official-src", type=Path,
                        help="a checkout of the official repository: after each family's levels, the side by "
                             "side with the official code on the device (perf/bench_official.py)")
    parser.add_argument("--official-venv", type=Path,
                        help="the official code's virtualenv (torch with CUDA), needed with --official-src")
    parser.add_argument("--official-concurrency", type=int, nargs="+", default=[1, 4],
                        help="streams at once in the side by side (default 1 4)")
    parser.add_argument("--official-repeats", type=int, default=2, help="interleaved rounds of each side")


def run_stages(model_dir: Path, family: str, args: argparse.Namespace, device: torch.device, out: Path) -> list[dict]:
    """The report sections of `family`'s folder `model_dir` that `args` asks for."""
    sections = []
    if args.stage_profile == "on":
        sections.append(section(f"{family}: where one stream's time goes",
                                lambda: profile_markdown(model_dir, args, device), device))
    if args.official_src is not None:
        sections.append(section(f"{family}: side by side with the official code",
                                lambda: official_markdown(model_dir, args, device, out / f"official-{family}"), device))
    return sections


def section(title: str, make: Callable[[], str], device: torch.device) -> dict:
    print(f"gpu_bench: {title} ...", flush=True)
    try:
        text = make()
    except Exception as error:  # noqa: BLE001 - reported in its section; the other parts still run
        text = f"Not run: {type(error).__name__}: {error}\n"
    finally:
        gc.collect()  # the part's models, before the next part loads its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"title": title, "markdown": text}


def setting_argv(model_dir: Path, args: argparse.Namespace, device: torch.device) -> list[str]:
    """perf/bench_official.py's setting arguments (`add_setting_arguments`) for this run."""
    speech, text, prompt = LENGTHS["quick" if args.quick else "full"]
    return ["--model-dir", str(model_dir), "--device", str(device), "--speech-tokens", str(speech),
            "--text-tokens", str(text), "--prompt-tokens", str(prompt), "--threads", str(torch.get_num_threads()),
            "--llm-precision", "auto", "--flow-precision", "auto"]


def profile_markdown(model_dir: Path, args: argparse.Namespace, device: torch.device) -> str:
    parser = argparse.ArgumentParser()
    stream_profile.add_arguments(parser)
    threads = torch.get_num_threads()
    try:
        report = stream_profile.profile(parser.parse_args(setting_argv(model_dir, args, device)))
    finally:
        torch.set_num_threads(threads)  # the profile sets its own
    return stream_profile.markdown(report)


def official_markdown(model_dir: Path, args: argparse.Namespace, device: torch.device, out: Path) -> str:
    if args.official_venv is None:  # making one needs a package registry, which a GPU machine may not reach
        raise ValueError("--official-src needs --official-venv (the official code's virtualenv)")
    parser = argparse.ArgumentParser()
    bench_official.add_arguments(parser)
    side_args = parser.parse_args([*setting_argv(model_dir, args, device), "--official-src", str(args.official_src),
                                   "--official-venv", str(args.official_venv), "--concurrency",
                                   *map(str, args.official_concurrency), "--repeats", str(args.official_repeats),
                                   "--out", str(out)])
    return bench_official.markdown(bench_official.side_by_side(side_args))
