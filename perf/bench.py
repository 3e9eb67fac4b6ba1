"""`cosyvoice-triton bench`: first-chunk latency, RTF and throughput by concurrency, with a report.

```
cosyvoice-triton bench --scenario fast_clone --concurrency 1 2 4 --requests 16 --triton localhost:8001
cosyvoice-triton bench --scenario long_text --gateway http://localhost:8080 --voice-mode audio
cosyvoice-triton bench --start --quick                 # its own tritonserver on the tiny random model
```
Exactly one target: `--triton host:port` (gRPC), `--gateway URL`, or `--start` (a tritonserver started
here through the launcher on `--model-dir`, default the tiny random folder, on free ports, stopped at the
end). `--quick`: concurrency 1 and 2, 2 requests each, short texts, and (with `--start`) a token/text
ratio of 3 so the random LLM stops early. One progress line per level; the report goes to `--out`
(default `perf/results/<timestamp>/`): report.md, results.json, first_chunk.png, rtf_throughput.png.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from . import loadgen, report, scenarios

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK_RATIO = 3.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=scenarios.NAMES, default="fast_clone")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="levels (default 1 2 4 8 16)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default 16)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--triton", metavar="HOST:PORT", help="Triton gRPC endpoint (model cosyvoice2)")
    target.add_argument("--gateway", metavar="URL", help="gateway base URL (streamed POST /v1/tts)")
    target.add_argument("--start", action="store_true", help="start a tritonserver here for the run")
    p.add_argument("--model-dir", default=None, help="with --start: model folder (default: the tiny random one)")
    p.add_argument("--model", default=None, help="model name for the report (default: from --model-dir)")
    p.add_argument("--device", default="cpu", help="with --start: device of llm and token2wav")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="with --start: torch threads per llm/token2wav instance (default 0: torch's; --quick: 1)")
    p.add_argument("--voice-mode", choices=loadgen.VOICE_MODES, default="id",
                   help="id: register each prompt once and send its id; audio: send the prompt every time")
    p.add_argument("--api-key", default=None, help="gateway API key")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the first level")
    p.add_argument("--quick", action="store_true", help="concurrency 1 2, 2 requests each, short texts")
    p.add_argument("--out", type=Path, default=None, help="report folder (default perf/results/<timestamp>/)")


def _start_server(args, stack: ExitStack) -> tuple[str, str]:
    """Start tritonserver via the launcher; (grpc url, model label). Stopped when `stack` closes."""
    from ..server.launcher import ServeOptions, prepare

    run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cosyvoice-bench-")))
    options = ServeOptions(model_dir=args.model_dir, run_dir=run_dir, address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, device=args.device,
                           voice_store=str(run_dir / "voices.sqlite"),
                           max_token_text_ratio=QUICK_RATIO if args.quick else None,
                           torch_threads=args.torch_threads if args.torch_threads is not None else
                           (1 if args.quick else 0))
    server = prepare(options, die_with_parent=True)
    print(f"starting tritonserver (log {server.log_path}) ...", file=sys.stderr, flush=True)
    stack.callback(server.stop)
    server.start()
    return server.grpc_url, args.model or (str(args.model_dir) if args.model_dir else "tiny (random weights)")


def _server_version(grpc_url: str) -> str | None:
    try:
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(grpc_url) as client:
            meta = client.get_server_metadata()
            return f"{meta.name} {meta.version}"
    except Exception:  # noqa: BLE001 - informative only
        return None


def run(args) -> int:
    if not (args.triton or args.gateway or args.start):
        print("error: give a target: --triton HOST:PORT, --gateway URL or --start", file=sys.stderr)
        return 2
    concurrency = args.concurrency or ([1, 2] if args.quick else [1, 2, 4, 8, 16])
    requests = args.requests or (2 if args.quick else 16)
    out = args.out or RESULTS_DIR / time.strftime("%Y%m%d-%H%M%S")
    scenario = scenarios.build(args.scenario, quick=args.quick)
    with ExitStack() as stack:
        if args.gateway:
            target, where, model = loadgen.GatewayTarget(args.gateway, api_key=args.api_key), args.gateway, \
                args.model or "unknown (set --model)"
            server_version = None
        else:
            if args.start:
                url, model = _start_server(args, stack)
            else:
                url, model = args.triton, args.model or "unknown (set --model)"
            target, where, server_version = loadgen.TritonTarget(url), url, _server_version(url)
        print(f"bench {scenario.name} on {target.kind} {where}: concurrency {concurrency}, {requests} requests "
              f"per level, voice by {args.voice_mode}, prompt by {scenario.cases[0].prompt_source}",
              file=sys.stderr, flush=True)

        async def go():
            try:
                return await loadgen.run_load(target, list(scenario.cases), concurrency, requests,
                                              voice_mode=args.voice_mode, warmup=args.warmup,
                                              on_level=lambda level: print(loadgen.progress_line(level),
                                                                           flush=True))
            finally:
                await target.close()

        levels = asyncio.run(go())
    env = report.environment(scenario=scenario.name, scenario_description=scenario.description,
                             target=f"{target.kind} {where}", voice_mode=args.voice_mode, model=model,
                             server_version=server_version, requests_per_level=requests,
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
