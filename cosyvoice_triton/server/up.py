"""`cosyvoice-triton up`: tritonserver (through the launcher) and the gateway together, one command.

1. The model folder (`--model-dir`, a hub id, or the tiny random folder made on first use) and the voice
   store (`--redis-url`, `--voice-store`, or `$COSYVOICE_HOME/voices.sqlite`) are resolved once, so
   the Triton models and the gateway use the same ones.
2. tritonserver starts (on 127.0.0.1 by default: clients talk to the gateway) and is waited for.
3. The gateway serves on `--host`/`--port` (default 0.0.0.0:8080) in front of it (and of any further
   `--triton` servers); at first start it registers voice `default`.
4. Ctrl-C / SIGTERM stops the gateway (WebSockets get GOING_AWAY), then tritonserver. If tritonserver
   exits on its own, the gateway stops too and the command exits with 1.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TextIO

from cosyvoice_triton.gateway.config import TritonTarget, add_gateway_arguments, config_from_args, voice_store_url
from cosyvoice_triton.server.launcher import (ENGINES, PRECISIONS, ServeOptions, default_model_dir, prepare,
                                              resolve_voice_store)

log = logging.getLogger(__name__)

TRITON_WATCH_S = 1.0


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None,
                   help="model folder or hub id (default: a tiny random model made on first use)")
    add_gateway_arguments(p, triton_help="further Triton servers to route to besides the local one, "
                                         "grpc://host:port[?metrics=URL] (repeatable)")
    t = p.add_argument_group("tritonserver")
    t.add_argument("--run-dir", type=Path, default=None, help="where the rendered repository and log go")
    t.add_argument("--triton-address", default="127.0.0.1", help="address tritonserver listens on")
    t.add_argument("--triton-http-port", type=int, default=8000, help="0: a free port")
    t.add_argument("--triton-grpc-port", type=int, default=8001, help="0: a free port")
    t.add_argument("--triton-metrics-port", type=int, default=8002, help="0: a free port")
    t.add_argument("--device", default="cpu", help="torch device of llm and token2wav: cpu or cuda")
    t.add_argument("--instances", type=int, default=1, help="instances of the stateless models")
    t.add_argument("--workers", type=int, default=16, help="requests synthesized at once per cosyvoice2 instance")
    t.add_argument("--llm-max-batch", type=int, default=8, help="LLM streams decoded together (KV slots)")
    t.add_argument("--torch-threads", type=int, default=0, help="torch threads per llm/token2wav instance")
    t.add_argument("--engine", choices=ENGINES, default="torch", help="token2wav engine, as for `serve`")
    t.add_argument("--precision", choices=PRECISIONS, default="fp32", help="precision of TensorRT engines")
    t.add_argument("--onnx-dir", type=Path, default=None, help="exported ONNX graphs and TensorRT engines")
    t.add_argument("--max-token-text-ratio", type=float, default=None, help=argparse.SUPPRESS)  # tests


def _port(value: int) -> int | None:
    return None if value == 0 else value


def up(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from cosyvoice_triton.gateway.app import create_app, run
    from cosyvoice_triton.model_hub import resolve_model_dir

    model_dir = Path(resolve_model_dir(args.model_dir)) if args.model_dir else default_model_dir()
    voice_store = resolve_voice_store(voice_store_url(args))
    options = ServeOptions(model_dir=model_dir, run_dir=args.run_dir, address=args.triton_address,
                           http_port=_port(args.triton_http_port), grpc_port=_port(args.triton_grpc_port),
                           metrics_port=_port(args.triton_metrics_port), device=args.device,
                           instances=args.instances, workers=args.workers, voice_store=voice_store,
                           llm_max_batch=args.llm_max_batch, torch_threads=args.torch_threads,
                           engine=args.engine, precision=args.precision, onnx_dir=args.onnx_dir,
                           max_text_chars=args.max_text_chars, max_token_text_ratio=args.max_token_text_ratio)
    server = prepare(options, die_with_parent=True)  # one service: tritonserver never outlives the gateway
    print(f"starting tritonserver (log: {server.workdir / 'tritonserver.log'}) ...", file=out, flush=True)
    try:
        server.start()
        local = TritonTarget(grpc=server.grpc_url, metrics_url=server.metrics_url)
        extra = tuple(TritonTarget.parse(s) for s in args.triton)
        config = config_from_args(args, triton=(local, *extra), model_dir=model_dir)
        config = dataclasses.replace(config, voice_store=voice_store)
        app = create_app(config)
        triton_exited = []
        app.cleanup_ctx.append(_watch(server, triton_exited))
        host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
        print(f"cosyvoice-triton: serving {args.model_dir or 'the tiny random model'}\n"
              f"  gateway  http://{host}:{config.port}   (POST /v1/tts, WS /v1/tts/ws, POST /v1/audio/speech, "
              f"/v1/voices)\n"
              f"  triton   grpc {server.grpc_url}, metrics {server.metrics_url}\n"
              f"  voices   {voice_store}\n"
              f"  log      {server.log_path}\n"
              "Press Ctrl-C to stop.", file=out, flush=True)
        run(config, app, print_fn=lambda *a, **k: None)
        if triton_exited:
            print(f"tritonserver exited; log {server.log_path}:\n{server.log_tail(20)}", file=sys.stderr)
            return 1
        return 0
    finally:
        code = server.stop()
        print(f"tritonserver stopped (exit code {code})", file=out, flush=True)


def _watch(server, exited: list):
    """cleanup_ctx: stop the gateway (as SIGTERM would) when tritonserver exits by itself."""

    async def watch(app):
        async def loop():
            while server.is_running():
                await asyncio.sleep(TRITON_WATCH_S)
            exited.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    return watch
