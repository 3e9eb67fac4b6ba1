"""GPU mode of the benchmark: the serving engines driven in this process, with no Triton server.

    bash perf/gpu_bench.sh                                          # on a machine with an NVIDIA GPU
    python -m cosyvoice_triton.perf.gpu_bench --device cpu --size tiny --quick      # a smoke run on a CPU

Each model family (`--family`, default both: CosyVoice2 and CosyVoice3) runs on a random folder of its own
(`--size`, as `cosyvoice-triton export --family F --size S` writes it), or the one `--model-dir` names.
What runs is the streaming model's serving path without its transport: the shared `Pipeline`
(sentences -> LLM token streams -> token2wav chunks) over `LLMScheduler` (in-flight batching of the LLM
streams in its own thread, as the `llm` model runs it) and `Token2WavScheduler` (flow + HiFT batched across
streams) behind `BatchingToken2WavStage`, which gathers waiting chunks into one scheduler call as Triton's dynamic
batcher does for the `token2wav` model. Each concurrency level has N client threads; each sends a request,
reads its chunks to the end and sends the next, until the level's requests are done. Left out: gRPC, BLS
hops and tensor copies between models, and the cosyvoice2 worker pool (each client runs its own request).

Variants: each `--cuda-graphs` setting with each `--llm-precision` (default: off and on, fp32 and bf16), each
on a stack of its own, built as the Triton models build theirs: `LLMScheduler(cuda_graphs=...)` with its
decode graphs warmed, `capture_estimator_steps` on the flow (engines/cuda_graphs.py); the time budget is
shared out between the variants still to run.

A voice is encoded once per prompt before the levels (as `bench --voice-mode id`). `--time-budget-s`
counts from the start of each family's part (its model writing included): a level whose estimated time does
not fit is not started, a level that reaches the deadline starts no more requests, and the report says so.
After each family's levels, outside the budget, perf/gpu_stages.py times one stream's stages on the device
(LLM prefill and decode steps, flow and vocoder calls) and, given `--official-src` and `--official-venv`,
runs the side by side with the official code on the same device. The report (report.md,
results.json, one PNG per scenario) goes to `--out`, default $COSYVOICE_PERF_RESULTS/gpu-<timestamp>/
(perf/results/ of the checkout when that is unset); report.md and results.json are rewritten after every level.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cosyvoice_triton.engines.cuda_graphs import capture_estimator_steps, use_cuda_graphs
from cosyvoice_triton.family import FAMILIES, family_named, family_of
from cosyvoice_triton.engines.select import build_token2wav, resolve_engine, unavailable_reason
from cosyvoice_triton.preprocess.prompt import PromptEncoder
from cosyvoice_triton.preprocess.text import TextPreprocessor
from cosyvoice_triton.messages import SynthesisRequest
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.perf import gpu_stages, scenarios
from cosyvoice_triton.perf.gpu_report import RANDOM_LLM_NOTE, environment, progress_line, write_outputs
from cosyvoice_triton.perf.report import results_dir
from cosyvoice_triton.perf.stats import RequestResult, percentile
from cosyvoice_triton.pipeline.audible import AudibleDetector
from cosyvoice_triton.random_folder.write import write_random_model
from cosyvoice_triton.pipeline.local_stages import BatchingToken2WavStage, LocalLLMStage
from cosyvoice_triton.llm.scheduler import LLMScheduler
from cosyvoice_triton.pipeline.pipeline import Pipeline
from cosyvoice_triton.token2wav.scheduler import Token2WavScheduler
from cosyvoice_triton.server.launcher import ServeOptions

QUICK_RATIO = 3.0  # --quick: at most 3 speech tokens per text token, so the random LLM stops early


# ---- packages a GPU machine may lack ---------------------------------------------------------------

class UnchangedText:
    """A text normalizer that leaves the text as written: the text preprocessor's normalizers where wetext is
    not installed."""

    def normalize(self, text: str) -> str:
        return text


def check_packages() -> tuple[tuple[UnchangedText, UnchangedText] | None, list[str]]:
    """(normalizers for the text preprocessor, None meaning wetext's; one report note per missing package).
    A GPU container may have neither wetext nor soundfile: the library imports wetext only to build its
    normalizers and soundfile only to decode file bytes, which this benchmark never does (it passes
    prompt samples)."""
    normalizers, notes = None, []
    try:
        import wetext  # noqa: F401 - loads its FSTs, which the text preprocessor then uses
    except ImportError:
        normalizers = (UnchangedText(), UnchangedText())
        notes.append("wetext is not installed: text normalization (number and symbol spelling) is skipped; "
                     "the scenario texts need little of it")
    try:
        import soundfile  # noqa: F401
    except (ImportError, OSError):  # OSError: the wheel is there but libsndfile is not
        notes.append("soundfile is not installed: no prompt file is decoded (the benchmark passes samples)")
    return normalizers, notes


@dataclass(frozen=True)
class Variant:
    cuda_graphs: str  # off | on (engines/cuda_graphs.py)
    llm_precision: str  # fp32 | bf16 (models/llm_precision.py)
    family: str = ""  # the model family's name when the run has more than one, else ""

    @property
    def label(self) -> str:
        family = f"{self.family}, " if self.family else ""
        return f"{family}CUDA graphs {self.cuda_graphs}, LLM {self.llm_precision}"

    @property
    def slug(self) -> str:
        family = f"{self.family}-" if self.family else ""
        return f"{family}graphs-{self.cuda_graphs}-{self.llm_precision}"


@dataclass
class Stack:
    """Everything one run serves with."""

    pipeline: Pipeline
    llm_scheduler: LLMScheduler
    t2w_scheduler: Token2WavScheduler
    batcher: BatchingToken2WavStage
    prompt_encoder: PromptEncoder
    sampling: object  # llm.sampling.SamplingParams: the model's defaults
    sample_rate: int
    settings: dict

    def close(self) -> None:
        self.llm_scheduler.stop()
        self.batcher.close()


def open_stack(model_dir: Path, args: argparse.Namespace, device: torch.device, onnx_dir: Path,
               normalizers: tuple | None, variant: Variant) -> Stack:
    """The engines and the pipeline on `device`, set up as the Triton models set them up (the text
    preprocessor with `normalizers`, None: wetext's)."""
    llm = SpeechLM.from_model_dir(model_dir, device=device, max_batch=args.llm_max_batch,
                                  max_seq_len=args.llm_max_seq_len, precision=variant.llm_precision)
    if args.max_token_text_ratio is not None:
        llm.config.max_token_text_ratio = args.max_token_text_ratio
    graphs = use_cuda_graphs(variant.cuda_graphs, device)  # `on` on a CPU: one warning line, eager
    llm_scheduler = LLMScheduler(llm, max_batch=args.llm_max_batch, max_seq_len=args.llm_max_seq_len,
                                 max_queue=args.llm_max_queue, cuda_graphs=graphs)
    decode = f"decode step from CUDA graphs: {llm_scheduler.decode_graphs.warm_up_report()}" if graphs else "eager"
    engine = resolve_engine(args.engine, device)  # a fallback is one warning line from engines/select.py
    flow, hift = build_token2wav(model_dir, engine, device, precision=args.precision, onnx_dir=onnx_dir,
                                 max_streams=args.t2w_max_batch)
    estimator_graphs = graphs and capture_estimator_steps(flow, args.t2w_max_batch)
    t2w_scheduler = Token2WavScheduler(flow, hift, max_streams=args.t2w_max_streams, max_batch=args.t2w_max_batch)
    engine_line = engine if engine == args.engine else \
        f"{engine} ({args.engine} unavailable: {unavailable_reason(args.engine, device)})"
    settings = {
        "llm": f"LLMScheduler on {device}: {args.llm_max_batch} slots, max_seq_len {args.llm_max_seq_len}, "
               f"queue {args.llm_max_queue}; max speech tokens per text token "
               f"{llm.config.max_token_text_ratio:g}; backbone {llm.precision}; {decode}",
        "token2wav": f"{engine_line}, precision {args.precision if engine == 'tensorrt' else 'fp32'}; "
                     f"Token2WavScheduler max_batch {args.t2w_max_batch}, max_streams {args.t2w_max_streams}; "
                     f"batcher delay {args.queue_delay_us} us; "
                     + ("estimator step from CUDA graphs per (rows, frames) bucket, no flow cache"
                        if estimator_graphs else "eager" + (", flow cache on" if t2w_scheduler.flow_cache else ""))}
    prompt_encoder = PromptEncoder.from_model_dir(model_dir)
    preprocessor = TextPreprocessor.from_model_dir(model_dir, normalizers=normalizers)
    # The two threads start last: nothing after them can fail and leave them running.
    batcher = BatchingToken2WavStage(t2w_scheduler, args.t2w_max_batch, args.queue_delay_us / 1e6)
    llm_scheduler.start()
    pipeline = Pipeline(preprocessor, LocalLLMStage(llm_scheduler), batcher)
    return Stack(pipeline=pipeline, llm_scheduler=llm_scheduler, t2w_scheduler=t2w_scheduler, batcher=batcher,
                 prompt_encoder=prompt_encoder, sampling=llm.config.sampling,
                 sample_rate=hift.config.sampling_rate, settings=settings)


# ---- load generation ------------------------------------------------------------------------------

def one_request(stack: Stack, case: scenarios.Case, voice, seed: int) -> RequestResult:
    """Stream one request through the pipeline; times from handing it over (s)."""
    result, chunks, samples = RequestResult(), 0, 0
    audible = AudibleDetector(stack.sample_rate)  # the first sample a listener hears (pipeline/audible.py)
    start = time.perf_counter()
    try:
        request = SynthesisRequest(text=case.text, voice=voice, mode=case.mode, seed=seed,
                                     sampling=stack.sampling)
        for chunk in stack.pipeline.run(request, stream=True):
            if chunk.size == 0:
                continue
            chunks, samples = chunks + 1, samples + chunk.size
            if chunks == 1:
                result.first_chunk_s = time.perf_counter() - start
            elif chunks == 2:
                result.second_chunk_s = time.perf_counter() - start
            audible.feed(chunk, time.perf_counter() - start)
        audible.finish()
        result.first_audible_s = audible.at
    except Exception as exc:  # noqa: BLE001 - counted as this request's error; the level goes on
        result.error = f"{type(exc).__name__}: {exc}"
    result.total_s = time.perf_counter() - start
    result.audio_s = samples / stack.sample_rate
    return result


def run_level(stack: Stack, cases: list, voices: dict, concurrency: int, requests: int, deadline: float,
              seed: int) -> tuple[list[RequestResult], float]:
    """`concurrency` client threads share `requests` requests (case i % len(cases), seed + i); none starts
    after `deadline` (time.monotonic()). Returns the results and the level's wall time."""
    results: list[RequestResult] = []
    lock = threading.Lock()
    taken = 0

    def client() -> None:
        nonlocal taken
        while time.monotonic() < deadline:
            with lock:
                index, taken = taken, taken + 1
            if index >= requests:
                return
            case = cases[index % len(cases)]
            result = one_request(stack, case, voices[id(case.prompt_audio)], seed + index)
            with lock:
                results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, name=f"client-{k}") for k in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start


def summarize(concurrency: int, planned: int, results: list[RequestResult], wall_s: float,
              flow_batch: float | None) -> dict:
    """One level's numbers, in seconds (keys as loadgen's summary, plus a few)."""
    ok = [r for r in results if r.error is None]
    audio = sum(r.audio_s for r in ok)
    out = {"concurrency": concurrency, "planned": planned, "requests": len(results),
           "errors": len(results) - len(ok), "wall_s": wall_s, "audio_s": audio,
           "audio_per_request_s": audio / len(ok) if ok else None,
           "rtf": wall_s / audio if audio else None, "throughput": audio / wall_s if wall_s else None,
           "flow_batch_mean": flow_batch, "first_error": next((r.error for r in results if r.error), None)}
    for name in ("first_chunk", "first_audible", "second_chunk", "total"):
        values = [getattr(r, f"{name}_s") for r in ok if getattr(r, f"{name}_s") is not None]
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(values, q)
    return out


def flow_rows(scheduler: Token2WavScheduler) -> tuple[int, float]:
    """(flow calls, rows in them) so far, to get a level's mean flow batch from two readings."""
    stats = scheduler.stats
    return stats.flow_calls, stats.mean_flow_batch * stats.flow_calls


def measure(stack: Stack, cases: list, voices: dict, concurrency: int, requests: int, deadline: float,
            seed: int) -> dict:
    """Run one level and summarize it, with the mean flow batch of its token2wav calls."""
    calls0, rows0 = flow_rows(stack.t2w_scheduler)
    results, wall = run_level(stack, cases, voices, concurrency, requests, deadline, seed)
    calls1, rows1 = flow_rows(stack.t2w_scheduler)
    return summarize(concurrency, requests, results, wall, (rows1 - rows0) / (calls1 - calls0)
                     if calls1 > calls0 else None)


def estimate_s(previous: dict | None, concurrency: int, requests: int) -> float:
    """Seconds a level should take: ceil(requests / concurrency) rounds of one request per client, each as
    long as the previous level's (or the warm-up's) median request. Latency seldom drops as concurrency
    grows, so this errs on the short side; the deadline then cuts a level that runs longer."""
    if previous is None or previous["total_p50_s"] is None:
        return 0.0
    return math.ceil(requests / concurrency) * previous["total_p50_s"]


# ---- the run ------------------------------------------------------------------------------------------

def prepare_model(args: argparse.Namespace, family: str) -> tuple[Path, str]:
    """The model folder of `family` (its random one written now unless --model-dir) and its report line."""
    if args.model_dir is not None:
        return args.model_dir, f"{args.model_dir} (given)"
    model_dir = args.work_dir / f"{family}-{args.size}"
    if (model_dir / family_named(family).speech_tokenizer_file).exists():  # the last file write_random_model writes
        return model_dir, f"{family}, {args.size} random weights, reused from {model_dir}"
    start = time.perf_counter()
    write_random_model(model_dir, size=args.size, backbone_weights=False, family=family)  # the LLM reads llm.pt only
    return model_dir, (f"{family}, {args.size} random weights, written to {model_dir} in "
                       f"{time.perf_counter() - start:.0f} s")


def encode_voices(stack: Stack, cases: tuple) -> dict:
    """Voice features per prompt recording (keyed by the array's id: cases of a scenario share it)."""
    voices = {}
    for case in cases:
        if id(case.prompt_audio) not in voices:
            voices[id(case.prompt_audio)] = stack.prompt_encoder.encode(case.prompt_audio, case.prompt_rate,
                                                                        case.prompt_text)
    return voices


def run_scenario(stack: Stack, name: str, args: argparse.Namespace, deadline: float, record: dict,
                 save) -> None:
    """Warm-up, then each level that fits before `deadline` (time.monotonic()), into `record` (saved after every
    level)."""
    scenario = scenarios.build(name, quick=args.quick)
    cases = list(scenario.cases)
    record.update(description=scenario.description,
                  prompt=f"{cases[0].prompt_source}, {cases[0].prompt_seconds:.1f} s")
    voices = encode_voices(stack, scenario.cases)
    previous = None
    if args.warmup:
        previous = record["warmup"] = measure(stack, cases, voices, 1, args.warmup, deadline, args.seed)
        print(progress_line(f"{name} warm-up", previous), flush=True)
    for concurrency in args.concurrency:
        requests = args.requests or (2 if args.quick else max(16, 2 * concurrency))
        left = deadline - time.monotonic()
        needed = estimate_s(previous, concurrency, requests)
        if left <= 0 or needed > left:
            why = "spent" if left <= 0 else f"short: about {needed:.1f} s needed, {left:.1f} s left"
            record["skipped"].append(f"concurrency {concurrency} not started: the time budget is {why}")
            continue
        level = measure(stack, cases, voices, concurrency, requests, deadline, args.seed)
        if level["requests"] < requests:
            record["skipped"].append(f"concurrency {concurrency} cut at the time budget after "
                                     f"{level['requests']} of {requests} requests")
        record["levels"].append(level)
        previous = level
        print(progress_line(name, level), flush=True)
        save(plots=False)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    normalizers, notes = check_packages()
    device = torch.device(args.device)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    out = args.out or results_dir() / time.strftime("gpu-%Y%m%d-%H%M%S")
    families = [family_of(args.model_dir).name] if args.model_dir is not None else args.family
    if args.model_dir is None:
        notes.append(RANDOM_LLM_NOTE)
    several_families = len(families) > 1
    variants = [Variant(graphs, precision, family if several_families else "") for family in families
                for graphs in args.cuda_graphs for precision in args.llm_precision]
    several = len(variants) > 1
    settings = {"voice": "encoded once per prompt before the levels (as bench --voice-mode id)",
                "warm-up": f"{args.warmup} request(s) at concurrency 1 before each scenario, not measured",
                "clients": "one thread per concurrent request; each sends its next request when one ends",
                "time budget": f"{args.time_budget_s:.0f} s " + ("per family, from the start of its part"
                                                                if several_families else "from the start")
                               + ", model writing included"
                               + (", shared out between the variants still to run" if several else "")}
    results = {"environment": environment(device), "settings": settings, "notes": notes, "scenarios": [],
               "stages": []}

    def save(plots: bool) -> str:
        settings["time used"] = f"{time.monotonic() - started:.0f} s"
        if device.type == "cuda":
            settings["peak GPU memory"] = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated"
        return write_outputs(results, out, plots)

    print(f"gpu_bench: {', '.join(families)} on {device}; report in {out}", flush=True)
    for family in families:
        part_start = time.monotonic()
        model_dir, model_line = prepare_model(args, family)
        settings[f"model ({family})" if several_families else "model"] = model_line
        part = [v for v in variants if v.family in (family, "")]
        for index, variant in enumerate(part):
            deadline = time.monotonic() + (part_start + args.time_budget_s - time.monotonic()) / (len(part) - index)
            run_variant(model_dir, model_line, variant, args, device, normalizers, deadline, results, save, several)
        results["stages"] += gpu_stages.run_stages(model_dir, family, args, device, out)
        save(plots=False)
    print(save(plots=True), flush=True)
    errors = sum(level["errors"] for record in results["scenarios"] for level in record["levels"])
    return 0 if errors == 0 else 1


def run_variant(model_dir: Path, model_line: str, variant: Variant, args: argparse.Namespace, device: torch.device,
                normalizers: tuple | None, deadline: float, results: dict, save, several: bool) -> None:
    """Every scenario of `args` on the stack of `variant`, into `results` (saved after every level)."""
    settings = results["settings"]
    stack = open_stack(model_dir, args, device, args.work_dir / f"onnx_{model_dir.name}", normalizers, variant)
    prefix = f"{variant.label}: " if several else ""
    settings[f"{prefix}llm"], settings[f"{prefix}token2wav"] = stack.settings["llm"], stack.settings["token2wav"]
    print(f"gpu_bench: {model_line}; {prefix}{stack.settings['token2wav']}", flush=True)
    try:
        for name in args.scenario:
            record = {"name": name, "levels": [], "skipped": []}
            if several:
                record.update(variant=variant.label, slug=variant.slug)
            results["scenarios"].append(record)
            run_scenario(stack, name, args, deadline, record, save)
    finally:
        stack.close()
    del stack  # its models and graphs, before the next variant's
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.perf.gpu_bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda[:N], or cpu for a smoke run of the same code")
    p.add_argument("--family", choices=[f.name for f in FAMILIES], nargs="+", default=[f.name for f in FAMILIES],
                   help="model families, each on a random folder of its own (default: all)")
    p.add_argument("--size", choices=["tiny", "full"], default="full", help="random model folders to write")
    p.add_argument("--model-dir", type=Path, help="an existing model folder instead of random ones (its family "
                                                  "alone runs)")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "cosyvoice_gpu_bench",
                   help="where the random folder and exported graphs go (reused when present)")
    p.add_argument("--scenario", nargs="+", choices=scenarios.NAMES, default=["fast_clone"])
    p.add_argument("--concurrency", type=int, nargs="+", help="levels (default 1 4 16 64; --quick: 1 2)")
    p.add_argument("--cuda-graphs", choices=["off", "on"], nargs="+",
                   help="variants: the LLM's decode step and the flow estimator's step eager (off) or from CUDA "
                        "graphs (on; on a CPU: eager, one warning line) (default off on; --quick: off)")
    p.add_argument("--llm-precision", choices=["fp32", "bf16"], nargs="+",
                   help="variants: the LLM backbone's precision (default fp32 bf16; --quick: fp32); each with "
                        "each --cuda-graphs setting")
    p.add_argument("--requests", type=int, help="requests per level (default max(16, 2 x concurrency); "
                                                "--quick: 2)")
    p.add_argument("--engine", choices=["torch", "onnxruntime", "tensorrt"], default=ServeOptions.engine,
                   help="token2wav engine; one that cannot run here falls back (tensorrt -> onnxruntime -> torch)")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default=ServeOptions.precision,
                   help="of TensorRT plans")
    p.add_argument("--llm-max-batch", type=int, help="LLM slots (default: the largest level, at least the "
                                                     f"server's {ServeOptions.llm_max_batch})")
    p.add_argument("--llm-max-seq-len", type=int, default=ServeOptions.llm_max_seq_len)
    p.add_argument("--llm-max-queue", type=int, default=ServeOptions.llm_max_queue)
    p.add_argument("--t2w-max-batch", type=int, default=ServeOptions.t2w_max_batch, help="chunks per flow call")
    p.add_argument("--t2w-max-streams", type=int, default=ServeOptions.t2w_max_streams)
    p.add_argument("--queue-delay-us", type=int, default=ServeOptions.t2w_queue_delay_us,
                   help="token2wav batcher: longest wait for more chunks once one has come")
    p.add_argument("--max-token-text-ratio", type=float, help="LLM speech tokens per text token at most "
                                                              f"(default: the model's; --quick: {QUICK_RATIO:g})")
    p.add_argument("--warmup", type=int, help="unmeasured requests before each scenario (default 2; --quick: 1)")
    p.add_argument("--torch-threads", type=int, help="torch CPU threads (default: torch's; --quick: 1)")
    p.add_argument("--seed", type=int, default=1000, help="request i of a level uses seed + i")
    p.add_argument("--quick", action="store_true", help="levels 1 2, 2 requests each, short texts, ratio 3")
    p.add_argument("--time-budget-s", type=float, default=480.0,
                   help="seconds per family from the start of its part (model writing included) after which "
                        "no level or request starts; a level estimated to end later is not started")
    gpu_stages.add_arguments(p)
    p.add_argument("--out", type=Path, help="report folder (default $COSYVOICE_PERF_RESULTS/gpu-<time>, "
                                            "$COSYVOICE_PERF_RESULTS defaulting to perf/results)")
    args = p.parse_args(argv)
    args.concurrency = args.concurrency or ([1, 2] if args.quick else [1, 4, 16, 64])
    args.cuda_graphs = args.cuda_graphs or (["off"] if args.quick else ["off", "on"])
    args.llm_precision = args.llm_precision or (["fp32"] if args.quick else ["fp32", "bf16"])
    args.llm_max_batch = args.llm_max_batch or max(ServeOptions.llm_max_batch, *args.concurrency)
    if args.max_token_text_ratio is None and args.quick:
        args.max_token_text_ratio = QUICK_RATIO
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.torch_threads = args.torch_threads if args.torch_threads is not None else (1 if args.quick else 0)
    return args


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
