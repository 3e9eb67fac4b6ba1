"""`cosyvoice-triton bench`: first-chunk latency, RTF and throughput by concurrency, with a report.

```
cosyvoice-triton bench --scenario fast_clone --concurrency 1 2 4 --requests 16 --triton localhost:8001
cosyvoice-triton bench --scenario long_text --gateway http://localhost:8080 --voice-mode audio
cosyvoice-triton bench --gateway http://localhost:8080 --path ws     # the WebSocket /v1/tts/ws
cosyvoice-triton bench --start --quick                 # its own tritonserver on the tiny random model
cosyvoice-triton bench --start --quick --path ws       # ... behind a gateway started in this process
cosyvoice-triton bench --start --compare chunk_policy  # variants side by side in one report
cosyvoice-triton bench --gateway http://localhost:8080 --compare chunk_policy   # ... through the gateway
cosyvoice-triton bench --start --compare adaptive_chunks --start-buffer-ms 200  # fixed vs adaptive, interleaved
```
Exactly one target: `--triton host:port` (gRPC), `--gateway URL`, or `--start` (a tritonserver started
here through the launcher on `--model-dir`, default the tiny random folder, on free ports, stopped at the
end). `--path` picks how requests travel: `grpc` (Triton directly: `--triton`, and `--start`'s default),
`http` (the gateway's streamed POST /v1/tts: `--gateway`'s default) or `ws` (the gateway's WebSocket);
with `--start`, `http` and `ws` go through a gateway served from a thread of this process, in front of
the started server (it shares this process's CPU with the load generator).

`--compare AXIS` runs the same scenario, levels and seeds for each variant of one axis and writes one
report: `voice_cache` (voice id vs prompt audio with every request), `chunk_policy` (per-request chunk
overrides, on any path), `adaptive_chunks` (the fixed vs the adaptive chunk policy, per request, the
two interleaved level by level on one server), `llm_batching` (llm_max_batch 8 vs 1) and `engine` (torch vs onnxruntime,
+ tensorrt with `--device cuda`); the last two start one server per variant, in turn, and need
`--start`. See compare.py.

Every report also gives the playback stalls of each level's streams (share of streams with a stall,
p50/p99 stall time per stream, stalls per stream, worst stall), for a listener that starts at the first
chunk and for one that starts `--start-buffer-ms` (default 200) after it.

`--quick`: concurrency 1 and 2, 2 requests each, short texts, and (with `--start`) a token/text ratio of
3 so the random LLM stops early. One progress line per level; the report goes to `--out` (default
`perf/results/<timestamp>/`): report.md, results.json, first_chunk.png, rtf_throughput.png and
stalls.png (a comparison: throughput.png instead of rtf_throughput.png).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from cosyvoice_triton.perf import compare, loadgen, report, scenarios, serving

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_command(sub) -> None:
    """The `bench` subcommand on the `cosyvoice-triton` parser's subparsers (an entry point, see cli.py)."""
    p = sub.add_parser("bench", help="latency/RTF/throughput by concurrency against Triton or the gateway, "
                                     "with a markdown + PNG report")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=scenarios.NAMES, default="fast_clone",
                   help="the request shape: fast_clone (default: a short text and prompt), cross_lingual or "
                        "long_text (perf/scenarios.py)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="levels (default 1 2 4 8 16)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default 16)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--triton", metavar="HOST:PORT", help="Triton gRPC endpoint (model cosyvoice2)")
    target.add_argument("--gateway", metavar="URL", help="gateway base URL (--path http or ws)")
    target.add_argument("--start", action="store_true", help="start a tritonserver here for the run")
    p.add_argument("--path", choices=loadgen.PATHS, default=None,
                   help="grpc: Triton directly (default with --triton, --start); http: the gateway's streamed "
                        "POST /v1/tts (default with --gateway); ws: the gateway's WS /v1/tts/ws. With --start, "
                        "http and ws go through a gateway started in this process")
    p.add_argument("--compare", choices=compare.AXES, default=None,
                   help="run every variant of this axis (same scenario, levels, seeds) into one report")
    p.add_argument("--model-dir", default=None, help="with --start: model folder (default: the tiny random one)")
    p.add_argument("--model", default=None, help="model name for the report (default: from --model-dir)")
    p.add_argument("--device", default="cpu", help="with --start: device of llm and token2wav")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="with --start: torch threads per llm/token2wav instance (default 0: torch's; --quick: 1)")
    p.add_argument("--voice-mode", choices=loadgen.VOICE_MODES, default="id",
                   help="id: register each prompt once and send its id; audio: send the prompt every time")
    p.add_argument("--api-key", default=None, help="gateway API key")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the first level "
                                                         "(of each variant)")
    p.add_argument("--start-buffer-ms", type=float, default=1000 * loadgen.DEFAULT_START_BUFFER_S,
                   help="the second stall figure: playback starts this long after the first chunk (default 200)")
    p.add_argument("--token-text-ratio", type=float, default=None,
                   help="with --start: the random LLM speaks at most this many speech tokens per text token "
                        "(default: the model's 20; --quick: 3), to keep full-size runs short")
    p.add_argument("--request-timeout-s", type=float, default=serving.CLIENT_TIMEOUT_S,
                   help="the client's deadline for one whole request (default 600; a full-size folder at "
                        "concurrency 8 on a few CPU cores needs more)")
    p.add_argument("--quick", action="store_true", help="concurrency 1 2, 2 requests each, short texts")
    p.add_argument("--out", type=Path, default=None, help="report folder (default perf/results/<timestamp>/)")


def _path(args) -> str:
    """The request path of the target, checked against it."""
    if args.triton:
        if args.path not in (None, "grpc"):
            raise ValueError("--triton is a gRPC endpoint: use --gateway URL (or --start) for --path http/ws")
        return "grpc"
    if args.gateway:
        if args.path == "grpc":
            raise ValueError("--gateway takes --path http or ws; use --triton HOST:PORT for grpc")
        return args.path or "http"
    return args.path or "grpc"


def settings_from_args(args, concurrency: list[int]) -> serving.Settings:
    if not (args.triton or args.gateway or args.start):
        raise ValueError("give a target: --triton HOST:PORT, --gateway URL or --start")
    threads = args.torch_threads if args.torch_threads is not None else (1 if args.quick else 0)
    return serving.Settings(path=_path(args), start=args.start, url=args.triton or args.gateway,
                            api_key=args.api_key, model_dir=args.model_dir, device=args.device,
                            torch_threads=threads, quick=args.quick, token_text_ratio=args.token_text_ratio,
                            max_concurrency=max(concurrency), request_timeout_s=args.request_timeout_s)


def _model_label(args) -> str:
    if args.model:
        return args.model
    if args.start:
        return str(args.model_dir) if args.model_dir else "tiny (random weights)"
    return "unknown (set --model)"


def run(args) -> int:
    concurrency = args.concurrency or ([1, 2] if args.quick else [1, 2, 4, 8, 16])
    try:
        settings = settings_from_args(args, concurrency)
        report.pyplot()  # the plots need the `bench` extra: say so before the benchmark runs, not after
    except (ValueError, ModuleNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    requests = args.requests or (2 if args.quick else 16)
    out = args.out or RESULTS_DIR / time.strftime("%Y%m%d-%H%M%S")
    scenario = scenarios.build(args.scenario, quick=args.quick)
    if args.compare:
        load = compare.Load(scenario, concurrency, requests, args.warmup, args.start_buffer_ms / 1000)
        return compare.run(args.compare, settings, load, voice_mode=args.voice_mode, model=_model_label(args),
                           out=out)
    return run_single(args, settings, scenario, concurrency, requests, out)


def run_single(args, settings: serving.Settings, scenario: scenarios.Scenario, concurrency: list[int],
               requests: int, out: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="cosyvoice-bench-") as tmp, \
            serving.deployment(settings, Path(tmp)) as endpoint:
        print(f"bench {scenario.name} on {endpoint.describe()}: concurrency {concurrency}, {requests} requests "
              f"per level, voice by {args.voice_mode}, prompt by {scenario.cases[0].prompt_source}",
              file=sys.stderr, flush=True)
        levels = loadgen.measure(endpoint.target, list(scenario.cases), concurrency, requests,
                                 voice_mode=args.voice_mode, warmup=args.warmup,
                                 on_level=lambda level: print(loadgen.progress_line(level), flush=True),
                                 start_buffer_s=args.start_buffer_ms / 1000)
    env = report.environment(scenario=scenario.name, scenario_description=scenario.description,
                             target=endpoint.describe(), voice_mode=args.voice_mode, model=_model_label(args),
                             server_version=endpoint.server_version, requests_per_level=requests,
                             prompt_source=scenario.cases[0].prompt_source)
    paths = report.write([level.summary() for level in levels], env, out)
    print(f"report: {paths['markdown']}", flush=True)
    return 0 if all(level.errors == 0 for level in levels) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cosyvoice-triton bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
