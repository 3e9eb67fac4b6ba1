"""The flow's speed levers against the fp32 official path, judged by what a listener hears (perf/quality.py).

    python -m cosyvoice_triton.perf.flow_quality --model-dir DIR [--speech-tokens 250] [--prompt-tokens 75] \
        [--variants bf16 int8-dynamic int8-static cached-final quick fp64 threads-1 fp16-emulated] \
        [--seeds 0 1] [--threads 2] [--json OUT]

For each seed: one voice (a speech-like recording of P / 25 s through the prompt encoder) and N random speech
tokens; the reference (estimator fp32, `--threads`, the official chunk schedule) and each variant on the same
inputs, everything else alike (the same HiFT in fp32 and the same seeded vocoder noise on both sides, so only
the flow's difference reaches the waveform):
- offline: one full-attention pass over all N tokens (the official non-streamed path);
- streamed: the chunk schedule through a `Token2WavStream` with the flow caches on (as served); the mel is
  what the chunks emitted, end to end (perf/flow_paths.py).
Variants (`VARIANTS`), the levers: `bf16`, `int8-dynamic` (the estimator's precision, models/flow.py),
`int8-static` (the estimator's ONNX graph quantized by ONNX Runtime, perf/flow_int8_static.py),
`cached-final` (the official schedule with its last chunk a cached streaming call instead of the
full-attention pass) and `quick` (`serve --chunk-preset quick`: 15-token first hop and cached final); the
calibration, differences no listener is meant to
hear: `fp64` (the estimator in float64: how far fp32's own rounding is from exact), `threads-1` (fp32 on 1
thread: another summation order), `fp16-emulated` (the official runtime's fp16 GPU estimator, emulated on
the CPU: `Float16Rounding`). Chunk presets change only
the streamed path.

Each pass is scored by `quality.judge`: the flow's mel (SNR, log-mel distance, MCD), the vocoder's own f0 on
the two mels (HiFT's f0 predictor: RMSE, V/UV), the waveform (log-mel distance, MCD, f0 RMSE and gross errors,
V/UV; waveform SNR reported only). A variant passes when the worst over seeds and passes is within
`quality.BOUNDS`, the waveform's measures gated only with trained weights (a random folder's vocoder does not
render its mel: docs/benchmarks/quality.md). Printed as a markdown table (and written as JSON with --json).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from cosyvoice_triton.models.flow_cache import FlowCacheSettings
from cosyvoice_triton.perf import quality
from cosyvoice_triton.perf.flow_cache_bench import TimedToken2Wav
from cosyvoice_triton.perf.flow_paths import load_judged, offline, streamed


@dataclass(frozen=True)
class Variant:
    """A path to compare with the reference: the estimator's arithmetic, the chunk preset, the threads."""

    precision: str = "fp32"  # a FLOW_PRECISIONS name, or "int8-static" / "fp64" / "fp16-emulated"
    preset: str = "official"
    cached_final: bool | None = None  # None: the preset's last chunk
    threads: int | None = None  # None: the reference's
    calibration: bool = False  # a difference no one hears, measured to place the bounds

    @property
    def changes_offline(self) -> bool:
        return self.preset == "official" and self.cached_final is None


VARIANTS = {
    "bf16": Variant(precision="bf16"),
    "int8-dynamic": Variant(precision="int8-dynamic"),
    "int8-static": Variant(precision="int8-static"),
    "cached-final": Variant(cached_final=True),
    "quick": Variant(preset="quick"),
    "fp64": Variant(precision="fp64", calibration=True),
    "threads-1": Variant(threads=1, calibration=True),
    "fp16-emulated": Variant(precision="fp16-emulated", calibration=True),
}


class Float16Rounding(TorchFunctionMode):
    """Every floating output of every op rounded to float16 (overflow to inf, as in float16), each op computing
    in float32 from its float16-valued inputs: float16 storage with float32 accumulation, how a float16 GPU
    engine runs a graph. With the weights rounded once (`emulate_fp16`) it emulates the estimator in float16
    on a CPU without float16 arithmetic."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return tree_map(lambda t: t.half().float() if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                        else t, out)


class Float64(TorchFunctionMode):
    """Every op on float32 tensors run in float64 (its float32 inputs cast up): with the weights in float64,
    the estimator computes in float64 throughout; the solver takes float32 out, as it does of every precision."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def up(t):
            return t.double() if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t

        return func(*tree_map(up, args), **tree_map(up, kwargs or {}))


def emulate(flow, precision: str, model_dir: str | None = None):
    """`flow` with its estimator in `precision`: a FLOW_PRECISIONS name through the solver's own setting, the
    two calibration arithmetics around every estimator pass (the solver's `estimator_arithmetic`, which each
    solving path enters in the thread that runs the pass), or `int8-static`: the model folder's estimator graph
    quantized by ONNX Runtime (perf/flow_int8_static.py; a graph takes no flow cache, so each chunk re-runs
    every frame)."""
    solver = flow.decoder
    if precision == "int8-static":
        from cosyvoice_triton.perf.flow_int8_static import ort_estimator, static_int8_estimator

        solver.estimator = ort_estimator(static_int8_estimator(model_dir), torch.get_num_threads())
    elif precision in ("fp64", "fp16-emulated"):
        mode = Float64 if precision == "fp64" else Float16Rounding
        with torch.no_grad():
            for p in solver.estimator.parameters():
                p.data = p.data.double() if precision == "fp64" else p.data.half().float()
        solver.estimator_arithmetic = lambda device: mode()
    else:
        solver.set_precision(precision)
    return flow


def vocoder_f0(hift, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The vocoder's own f0 track of a mel (80, T): (f0 Hz (T,), voiced (T,)) from its f0 predictor and its
    voicing threshold: the pitch its source will run at."""
    dtype = next(hift.f0_predictor.parameters()).dtype
    with torch.inference_mode():
        f0 = hift.f0_predictor(torch.from_numpy(mel)[None].to(dtype))[0].double().numpy()
    return f0, f0 > hift.config.nsf_voiced_threshold


def judged(hift, reference: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]) -> quality.Scores:
    """quality.judge of two (mel (80, T), waveform) pairs, with the vocoder's f0 of each mel."""
    (mel, wave), (mel_t, wave_t) = reference, test
    return quality.judge(hift.config.sampling_rate, wave, wave_t, mel, mel_t, vocoder_f0(hift, mel),
                         vocoder_f0(hift, mel_t))


def with_threads(threads: int | None, run):
    """run() on `threads` torch threads (None: as set), the setting restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def measure(model_dir: str, speech_tokens: int, prompt_tokens: int, variants: list[str], seeds: list[int]) -> dict:
    """Per variant: each seed's scores per pass, the worst over them, the measures out of bound."""
    from cosyvoice_triton.random_folder.marker import is_random

    flow, hift, prompt = load_judged(model_dir, prompt_tokens)
    reference = TimedToken2Wav(flow, hift, FlowCacheSettings())
    inputs = {seed: torch.randint(0, flow.config.vocab_size, (speech_tokens,),
                                  generator=torch.Generator().manual_seed(seed)).tolist() for seed in seeds}
    official = {seed: {"offline": offline(reference, prompt, tokens, seed),
                       "streamed": streamed(reference, prompt, tokens, seed)} for seed, tokens in inputs.items()}
    trained = not is_random(model_dir)
    out = {}
    for name in variants:
        variant = VARIANTS[name]
        tested = reference
        if variant.precision != "fp32":
            tested = TimedToken2Wav(emulate(copy.deepcopy(flow), variant.precision, model_dir), hift,
                                    FlowCacheSettings())
        rows = []
        for seed, tokens in inputs.items():
            runs = {"streamed": lambda: streamed(tested, prompt, tokens, seed, variant.preset, variant.cached_final)}
            if variant.changes_offline:
                runs["offline"] = lambda: offline(tested, prompt, tokens, seed)
            rows.append({"seed": seed} | {path: judged(hift, official[seed][path], with_threads(variant.threads, run))
                                          for path, run in sorted(runs.items())})
        worst = quality.worst([row[path] for row in rows for path in ("offline", "streamed") if path in row])
        out[name] = {"variant": dataclasses.asdict(variant), "seeds": rows, "worst": worst,
                     "failures": quality.failures(worst, trained_vocoder=trained)}
        del tested
    return {"model_dir": model_dir, "speech_tokens": speech_tokens, "prompt_tokens": prompt_tokens,
            "threads": torch.get_num_threads(), "trained_vocoder": trained,
            "bounds": dataclasses.asdict(quality.BOUNDS), "variants": out}


def markdown(result: dict) -> str:
    b = quality.Bounds(**result["bounds"])
    gates = "flow mel, vocoder f0 and waveform" if result["trained_vocoder"] else \
        "flow mel and vocoder f0 (random weights: waveform measures reported, not gated)"
    lines = [f"flow variants against the fp32 official path; {result['speech_tokens']} speech tokens, "
             f"{result['prompt_tokens']}-token prompt, {result['threads']} threads; gates: {gates}; verdict on the "
             "worst over seeds and passes (offline where the variant changes it, streamed)", "",
             f"| variant | pass | mel SNR (>= {b.mel_snr_db:g} dB) | flow mel dist. (<= {b.log_mel_distance_db:g} dB) "
             f"| flow mel MCD (<= {b.mcd_db:g} dB) | vocoder f0 RMSE (<= {b.f0_rmse_hz:g} Hz) "
             f"| vocoder V/UV (>= {100 * b.vuv_agreement:g} %) | log-mel dist. | MCD | f0 RMSE | f0 gross "
             "| V/UV | waveform SNR (not a gate) | verdict |",
             "|---|---|" + "---:|" * 11 + "---|"]
    for name, v in result["variants"].items():
        for row in v["seeds"]:
            for path in ("offline", "streamed"):
                if path in row:
                    lines.append(_row(f"{name} (seed {row['seed']})", path, row[path], ""))
        verdict = "passes" if not v["failures"] else "fails: " + ", ".join(v["failures"])
        if v["variant"]["calibration"]:
            verdict = "(calibration) " + verdict
        lines.append(_row(f"**{name}**", "worst", v["worst"], verdict))
    return "\n".join(lines) + "\n"


def _cell(value: float | None, form: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(scale * value, form)


def _row(label: str, path: str, s: quality.Scores, verdict: str) -> str:
    cells = [_cell(s.mel_snr_db, ".1f"), _cell(s.flow_mel_distance_db, ".3f"), _cell(s.flow_mel_mcd_db, ".3f"),
             _cell(s.vocoder_f0_rmse_hz, ".2f"), _cell(s.vocoder_vuv_agreement, ".1f", 100),
             _cell(s.log_mel_distance_db, ".2f"), _cell(s.mcd_db, ".3f"), _cell(s.f0_rmse_hz, ".2f"),
             _cell(s.f0_gross_errors, ".1f", 100), _cell(s.vuv_agreement, ".1f", 100), _cell(s.wave_snr_db, ".1f")]
    return f"| {label} | {path} | " + " | ".join(cells) + f" | {verdict} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--speech-tokens", type=int, default=250)
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the result here, as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    result = measure(args.model_dir, args.speech_tokens, args.prompt_tokens, args.variants, args.seeds)
    result["load_average"] = (load, os.getloadavg()[0])
    print(markdown(result) + f"\nload average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, default=lambda scores: scores.as_dict())


if __name__ == "__main__":
    main()
