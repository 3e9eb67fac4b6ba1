"""Bursts of concurrent streams against a running service: which start, wait or are refused, and whether any
admitted stream's listener stalls (admission in real-time units: docs/operations/overload.md).

```
cosyvoice-triton up --model-dir TINY --port 8080 --triton-grpc-port 8001 &     # or --frontends 2 --backends 1
python -m cosyvoice_triton.perf.realtime_admission --gateway http://localhost:8080 --triton localhost:8001 \
    --concurrency 4 8 16 --out admission.json
```
Each burst sends N streamed requests at once, the paths mixed in turn (HTTP `/v1/tts`, the WebSocket, gRPC
straight to the `cosyvoice2` model of `--triton`; without `--triton`, HTTP and WebSocket only), each with
voice `default` and its own seed. Per request: refused (an overload refusal: 503 / UNAVAILABLE) or
admitted; an admitted one's first-chunk time and its listener (pipeline/playback.py `Playback`, starting
`--start-buffer` seconds after the first chunk): the longest wait for audio. A stall is a wait over
`--stall-tolerance` (50 ms). Bursts are separated by `--pause` seconds so the service is idle again.
The report: per burst, admitted / refused / waited (first chunk later than the fastest one by more than
1 s) / stalled streams, the worst stall, and the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from cosyvoice_triton.perf.loadgen import make_target, one_request
from cosyvoice_triton.perf.scenarios import Case
from cosyvoice_triton.perf.stats import RequestResult
from cosyvoice_triton.pipeline.playback import Playback

TEXTS = ("The train was late. Nobody seemed surprised.", "Good morning to everyone on the line today.",
         "Please hold while I look that up for you.", "One, two, three, four, five, six, seven.")
REFUSED = ("overloaded", "busy", "503", "UNAVAILABLE", "too_many_streams", "429")


def worst_wait(result: RequestResult, start_buffer_s: float) -> float:
    """The longest time the stream's listener waited for audio after it started playing."""
    playback, worst = Playback(start_buffer_s), 0.0
    for arrival, seconds in zip(result.arrivals, result.chunk_audio_s):
        worst = max(worst, -playback.add(arrival, seconds))
    return worst


async def burst(gateway: str, triton: str | None, count: int, seed: int) -> list[tuple[str, RequestResult]]:
    from cosyvoice_triton.random_folder.sample_prompt import speech_like

    prompt = speech_like(1.0, 16000, seed=0)  # unused with voice `default`; a Case needs one
    targets = [("http", make_target("http", gateway)), ("ws", make_target("ws", gateway))]
    if triton:
        targets.append(("grpc", make_target("grpc", triton)))

    async def one(index: int):
        path, target = targets[index % len(targets)]
        case = Case(prompt, 16000, "", TEXTS[index % len(TEXTS)])
        return path, await one_request(target, case, "default", seed + index)

    return await asyncio.gather(*(one(i) for i in range(count)))


def summarize(count: int, outcomes: list[tuple[str, RequestResult]], start_buffer_s: float,
              tolerance_s: float) -> dict:
    admitted = [(path, r) for path, r in outcomes if r.error is None]
    refused = [r for _, r in outcomes if r.error is not None and any(word in r.error for word in REFUSED)]
    failed = [r.error for _, r in outcomes if r.error is not None and r not in refused]
    waits = [worst_wait(r, start_buffer_s) for _, r in admitted]
    firsts = [r.first_chunk_s for _, r in admitted if r.first_chunk_s is not None]
    fastest = min(firsts, default=0.0)
    return {"concurrency": count, "admitted": len(admitted), "refused": len(refused), "failed": failed,
            "waited": sum(first > fastest + 1.0 for first in firsts),
            "stalled": sum(wait > tolerance_s for wait in waits), "worst_stall_s": round(max(waits, default=0.0), 3),
            "first_chunk_s": sorted(round(f, 2) for f in firsts), "load_average": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway", required=True, help="the gateway's base URL")
    p.add_argument("--triton", help="host:port of a tritonserver's gRPC endpoint (adds the gRPC path)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--start-buffer", type=float, default=0.3)
    p.add_argument("--stall-tolerance", type=float, default=0.05)
    p.add_argument("--pause", type=float, default=5.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    report = []
    for index, count in enumerate(args.concurrency):
        outcomes = asyncio.run(burst(args.gateway, args.triton, count, seed=1000 * (index + 1)))
        row = summarize(count, outcomes, args.start_buffer, args.stall_tolerance)
        print(json.dumps(row), flush=True)
        report.append(row)
        time.sleep(args.pause)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
