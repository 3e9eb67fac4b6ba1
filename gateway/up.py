"""`cosyvoice-triton up`: tritonserver (through the launcher) and the gateway together, one command.

A tool on top of the library (it stacks the gateway on `server.launcher`), so it lives here in gateway/;
the library's CLI finds it through the `cosyvoice_triton.commands` entry point in pyproject.toml.

1. The model folder (`--model-dir`, a hub id, or the tiny random folder made on first use) and the voice
   store (`--redis-url`, `--voice-store`, or `$COSYVOICE_HOME/voices.sqlite`) are resolved once, so
   the Triton models and the gateway use the same ones.
2. tritonserver starts (on 127.0.0.1 by default: clients talk to the gateway) and is waited for.
3. The gateway serves on `--host`/`--port` (default 0.0.0.0:8080) in front of it (and of any further
   `--triton` servers); at first start it registers voice `default`.
4. Ctrl-C / SIGTERM stops the gateway (WebSockets get GOING_AWAY), then tritonserver. If tritonserver
   exits on its own, the gateway stops too and the command exits with 1.

Split mode (`--frontends N --backends M`): instead of one server, a `SplitTopology` (backends with
token2wav, frontends with the rest calling them) behind the gateway, which routes over the frontends. The
voice store is Redis: `--redis-url`, or a redis-server started here in the run folder. A frontend that
dies is taken out of the pool by the gateway's health checks and the rest carry on; the command stops
when no frontend or no backend is left. `<run dir>/topology.json` lists every process and endpoint.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from cosyvoice_triton.gateway.config import add_gateway_arguments, config_from_args, split_triton_specs, voice_store_url
from cosyvoice_triton.targets import TritonTarget
from cosyvoice_triton.server.launcher import (ENGINES, PRECISIONS, ServeOptions, default_model_dir, prepare,
                                              resolve_voice_store)
from cosyvoice_triton.random_folder.marker import NOTE as RANDOM_NOTE, is_random
from cosyvoice_triton.server import free_port
from cosyvoice_triton.server.ports import check_ports_free
from cosyvoice_triton.server.templates import model_names

log = logging.getLogger(__name__)

TRITON_WATCH_S = 1.0
PROGRESS_EVERY_S = 10.0


def add_command(sub) -> None:
    """The `up` subcommand on the `cosyvoice-triton` parser's subparsers (an entry point, see cli.py)."""
    p = sub.add_parser("up", help="start tritonserver and the HTTP/WebSocket gateway together; Ctrl-C stops both")
    add_up_arguments(p)
    p.set_defaults(func=up)


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
    t.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="precision of TensorRT plans and OpenVINO's hint")
    t.add_argument("--ort-providers", default=None, metavar="LIST", help="onnxruntime providers, as for `serve`")
    t.add_argument("--onnx-dir", type=Path, default=None, help="exported ONNX graphs and TensorRT plans")
    t.add_argument("--t2w-idle-timeout", type=float, default=120.0,
                   help="seconds after which a token2wav stream with no new chunk is freed")
    t.add_argument("--max-token-text-ratio", type=float, default=None, help=argparse.SUPPRESS)  # tests
    s = p.add_argument_group("split deployment (both, or neither)")
    s.add_argument("--frontends", type=int, default=0,
                   help="frontend servers (cosyvoice2, llm, prompt encoder) behind the gateway, on free ports")
    s.add_argument("--backends", type=int, default=0, help="backend servers (token2wav) the frontends call")


def _port(value: int) -> int | None:
    return None if value == 0 else value


def up(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    check_up_ports(args)
    if args.frontends or args.backends:
        return up_split(args, out)
    args = with_fixed_triton_ports(args)  # the gateway needs Triton's address before Triton is up
    model_dir = resolve_model_dir(args, out)
    voice_store = resolve_voice_store(voice_store_url(args))
    options = serve_options(args, model_dir, voice_store)
    server = prepare(options, die_with_parent=True)  # one service: tritonserver never outlives the gateway
    print(f"starting tritonserver (log: {server.workdir / 'tritonserver.log'}) ...", file=out, flush=True)
    startup = TritonStartup(server, out)
    try:
        startup.begin()  # the gateway listens at once and answers 503 "starting" until Triton is ready
        lines = [f"  triton   grpc {server.grpc_url}, metrics {server.metrics_url} (starting: /readyz answers 503 "
                 f"until it is ready)", f"  voices   {voice_store}", f"  log      {server.log_path}"]
        code = run_gateway(args, (server.target,), model_dir, voice_store, lines, startup.gone, out)
        if code and startup.error is None:
            print(f"tritonserver exited; log {server.log_path}:\n{server.log_tail(20)}", file=sys.stderr)
        return code
    finally:
        code = server.stop()
        startup.stopped.set()
        print(f"tritonserver stopped (exit code {code})", file=out, flush=True)


class TritonStartup:
    """tritonserver started in a thread, so the gateway answers (503 "starting") while it loads; a progress
    line every PROGRESS_EVERY_S (models loaded of the repository's, elapsed), one when it is ready."""

    def __init__(self, server, out: TextIO):
        self.server, self.out = server, out
        self.finished = threading.Event()
        self.stopped = threading.Event()  # set once the server is stopped
        self.error: Exception | None = None

    def begin(self) -> None:
        threading.Thread(target=self._start, name="tritonserver-start", daemon=True).start()
        threading.Thread(target=self._report, name="tritonserver-progress", daemon=True).start()

    def gone(self) -> bool:
        """It failed to start, or exited after it started."""
        return self.finished.is_set() and (self.error is not None or not self.server.is_running())

    def _start(self) -> None:
        started = time.monotonic()
        try:
            self.server.start()
            print(f"tritonserver ready after {time.monotonic() - started:.0f} s: the gateway serves",
                  file=self.out, flush=True)
        except Exception as exc:  # noqa: BLE001 - reported here, and the gateway stops (gone())
            self.error = exc
            print(f"tritonserver did not start: {exc}", file=sys.stderr, flush=True)
        finally:
            self.finished.set()
        # die_with_parent is the kernel's parent-death signal, sent when the *thread* that started the
        # server ends: this thread lives until the server is stopped.
        self.stopped.wait()

    def _report(self) -> None:
        started = time.monotonic()
        models = model_names(self.server.model_repository)
        while not self.finished.wait(PROGRESS_EVERY_S):
            loaded = self.server.loaded_models()
            waiting = [m for m in models if m not in loaded]
            print(f"  tritonserver loading models: {len(loaded)} of {len(models)} loaded after "
                  f"{time.monotonic() - started:.0f} s (waiting for {', '.join(waiting) or 'the ports'})",
                  file=self.out, flush=True)


def with_fixed_triton_ports(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with each Triton port given as 0 replaced by a port free now."""
    fixed = {name: getattr(args, name) or free_port(args.triton_address)
             for name in ("triton_http_port", "triton_grpc_port", "triton_metrics_port")}
    return argparse.Namespace(**{**vars(args), **fixed})


def check_up_ports(args: argparse.Namespace) -> None:
    """Every port this command was told to listen on is free (a second `up` stops here, naming the port
    and its process, before it makes anything)."""
    check_ports_free(args.host or "0.0.0.0", {"the gateway's port (--port)": _port(args.port)})
    if not (args.frontends or args.backends):  # split mode puts its servers on free ports
        check_ports_free(args.triton_address, {
            "tritonserver's HTTP port (--triton-http-port)": _port(args.triton_http_port),
            "tritonserver's gRPC port (--triton-grpc-port)": _port(args.triton_grpc_port),
            "tritonserver's metrics port (--triton-metrics-port)": _port(args.triton_metrics_port)})


def up_split(args: argparse.Namespace, out: TextIO) -> int:
    """`--frontends N --backends M`: the split topology behind the gateway."""
    from cosyvoice_triton.server.launcher import new_run_dir
    from cosyvoice_triton.server.topology import SplitTopology

    if args.frontends < 1 or args.backends < 1:
        raise ValueError("split mode needs --frontends >= 1 and --backends >= 1")
    if args.voice_store:
        raise ValueError("split mode shares voices through Redis: give --redis-url (or nothing: a local "
                         "redis-server is started), not --voice-store")
    model_dir = resolve_model_dir(args)
    run_dir = Path(args.run_dir) if args.run_dir else new_run_dir()
    options = serve_options(args, model_dir, args.redis_url)
    topology = SplitTopology(options, args.frontends, args.backends, run_dir, die_with_parent=True)
    print(f"starting {args.backends} backend and {args.frontends} frontend tritonservers (in {run_dir}) ...",
          file=out, flush=True)
    try:
        topology.start()
        targets = tuple(f.target for f in topology.frontends)
        lines = [*(f"  frontend grpc {f.grpc_url}, metrics {f.metrics_url} (pid {f.pid})" for f in topology.frontends),
                 *(f"  backend  grpc {b.grpc_url}, metrics {b.metrics_url} (pid {b.pid})" for b in topology.backends),
                 f"  voices   {topology.voice_store}", f"  layout   {run_dir / 'topology.json'}"]

        def gone() -> bool:
            return not any(f.is_running() for f in topology.frontends) or \
                not any(b.is_running() for b in topology.backends)

        code = run_gateway(args, targets, model_dir, topology.voice_store, lines, gone, out)
        if code:
            print(f"no frontend or no backend is left; logs under {run_dir}", file=sys.stderr)
        return code
    finally:
        topology.stop()
        print("tritonservers stopped", file=out, flush=True)


def resolve_model_dir(args: argparse.Namespace, out: TextIO = sys.stdout) -> Path:
    """`--model-dir` (a folder or a hub id); without it the released model where one is available
    (model_hub.default_model: $COSYVOICE_MODEL_DIR, the hub caches, a download), and only then the tiny
    random folder, made on first use."""
    from cosyvoice_triton.model_hub import default_model, resolve_model_dir as resolve_hub_id

    if args.model_dir:
        return Path(resolve_hub_id(args.model_dir))
    choice = default_model(log=lambda line: print(line, file=out, flush=True))
    if choice.path is not None:
        print(f"model: {choice.path} (from {choice.source})", file=out, flush=True)
        return choice.path
    print("model: no released CosyVoice2-0.5B here ($COSYVOICE_MODEL_DIR, the ModelScope and Hugging Face "
          "caches, a download): the tiny random folder ...", file=out, flush=True)
    started = time.monotonic()
    folder = default_model_dir()
    print(f"model: {folder} ({time.monotonic() - started:.0f} s)", file=out, flush=True)
    return folder


def serve_options(args: argparse.Namespace, model_dir: Path, voice_store: str | None) -> ServeOptions:
    return ServeOptions(model_dir=model_dir, run_dir=args.run_dir, address=args.triton_address,
                        http_port=_port(args.triton_http_port), grpc_port=_port(args.triton_grpc_port),
                        metrics_port=_port(args.triton_metrics_port), device=args.device,
                        instances=args.instances, workers=args.workers, voice_store=voice_store,
                        llm_max_batch=args.llm_max_batch, torch_threads=args.torch_threads,
                        engine=args.engine, precision=args.precision, ort_providers=args.ort_providers,
                        onnx_dir=args.onnx_dir,
                        max_text_chars=args.max_text_chars, max_token_text_ratio=args.max_token_text_ratio,
                        t2w_idle_timeout_s=args.t2w_idle_timeout)


def run_gateway(args, targets: tuple[TritonTarget, ...], model_dir: Path, voice_store: str, lines: list[str],
                servers_gone, out: TextIO) -> int:
    """Serve the gateway in front of `targets` (plus any `--triton`) until Ctrl-C / SIGTERM (0) or until
    `servers_gone()` (1)."""
    from cosyvoice_triton.gateway.app import create_app, run

    extra, _ = split_triton_specs(args.triton)  # config_from_args keeps the dns:// ones
    config = config_from_args(args, triton=(*targets, *extra), model_dir=model_dir)
    config = dataclasses.replace(config, voice_store=voice_store)
    app = create_app(config)
    exited: list[bool] = []
    app.cleanup_ctx.append(_watch(servers_gone, exited))
    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    note = f"\n  WARNING  {RANDOM_NOTE}" if is_random(model_dir) else ""
    print(f"cosyvoice-triton: serving {model_dir}{note}\n"
          f"  gateway  http://{host}:{config.port}   (POST /v1/tts, WS /v1/tts/ws, POST /v1/audio/speech, "
          f"/v1/voices)\n" + "\n".join(lines) + "\nPress Ctrl-C to stop.", file=out, flush=True)
    run(config, app, print_fn=lambda *a, **k: None)
    return 1 if exited else 0


def _watch(servers_gone, exited: list):
    """cleanup_ctx: stop the gateway (as SIGTERM would) once `servers_gone()`."""

    async def watch(app):
        async def loop():
            while not servers_gone():
                await asyncio.sleep(TRITON_WATCH_S)
            exited.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    return watch
