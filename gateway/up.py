"""`cosyvoice-triton up`: tritonserver (through the launcher) and the gateway together, one command.

A tool on top of the library (the library's CLI finds it through the `cosyvoice_triton.commands` entry
point), so it lives in gateway/ and the library never imports it. What it starts, supervises and drains,
and split mode (`--frontends N --backends M`): docs/deployment/index.md and docs/operations/faults.md.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from cosyvoice_triton.cli import add_realtime_arguments
from cosyvoice_triton.errors import ParameterError
from cosyvoice_triton.gateway.config import (add_gateway_arguments, config_from_args, official_ports, split_triton_specs,
                                             voice_store_url)
from cosyvoice_triton.pipeline.chunk_policy import CHUNK_PRESETS
from cosyvoice_triton.targets import TritonTarget
from cosyvoice_triton.server.launcher import (ENGINES, PRECISIONS, ServeOptions, default_model_dir, prepare,
                                              resolve_voice_store)
from cosyvoice_triton.random_folder.marker import NOTE as RANDOM_NOTE, is_random
from cosyvoice_triton.server import free_port
from cosyvoice_triton.server.ports import check_ports_free
from cosyvoice_triton.server.liveness import Liveness
from cosyvoice_triton.server.process import TritonProcess
from cosyvoice_triton.server.supervisor import Backoff, Supervisor
from cosyvoice_triton.server.templates import model_names

from .drain import DRAIN_TIMEOUT_S
from .serving import serve_until_stopped

log = logging.getLogger(__name__)

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
                                         "grpc://host:port[?metrics=URL] (repeatable)", official_ports=True)
    t = p.add_argument_group("tritonserver")
    t.add_argument("--run-dir", type=Path, default=None, help="where the rendered repository and log go")
    t.add_argument("--triton-address", default="127.0.0.1", help="address tritonserver listens on")
    t.add_argument("--triton-http-port", type=int, default=8000, help="tritonserver's HTTP port (0: a free port)")
    t.add_argument("--triton-grpc-port", type=int, default=8001, help="tritonserver's gRPC port (0: a free port)")
    t.add_argument("--triton-metrics-port", type=int, default=8002,
                   help="tritonserver's metrics port (0: a free port)")
    t.add_argument("--device", default="cpu", help="torch device of llm and token2wav: cpu or cuda")
    t.add_argument("--instances", type=int, default=1, help="instances of the stateless models")
    t.add_argument("--workers", type=int, default=16, help="requests synthesized at once per cosyvoice2 instance")
    add_realtime_arguments(t)
    t.add_argument("--llm-max-batch", type=int, default=8, help="LLM streams decoded together (KV slots)")
    t.add_argument("--torch-threads", type=int, default=0,
                   help="torch threads per llm/token2wav instance (0: from the core count, see serve --help)")
    t.add_argument("--llm-precision", choices=("fp32", "bf16", "int8", "int8-dynamic", "auto"), default="auto",
                   help="the LLM backbone's precision (as serve --llm-precision; auto: from the CPU's instructions)")
    t.add_argument("--flow-precision", choices=("fp32", "bf16", "int8-dynamic", "auto"), default="auto",
                   help="the torch flow estimator's arithmetic (as serve --flow-precision)")
    t.add_argument("--compile", choices=("off", "auto", "on"), default="off",
                   help="torch.compile of the hot loops' blocks (as serve --compile)")
    t.add_argument("--cuda-graphs", choices=("off", "auto", "on"), default="auto",
                   help="CUDA graphs of the LLM's decode step and the flow estimator's step (as serve --cuda-graphs)")
    t.add_argument("--chunk-preset", choices=tuple(CHUNK_PRESETS), default="official",
                   help="the chunk schedule's defaults (as serve --chunk-preset)")
    t.add_argument("--official-models", action=argparse.BooleanOptionalAction, default=True,
                   help="also serve cosyvoice2_official and cosyvoice2_official_offline (cosyvoice3_official* on "
                        "a CosyVoice3 folder) for the official Triton clients, as for `serve` (default: on)")
    t.add_argument("--engine", choices=ENGINES, default="torch", help="token2wav engine, as for `serve`")
    t.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="precision of TensorRT plans and OpenVINO's hint")
    t.add_argument("--ort-providers", default=None, metavar="LIST", help="onnxruntime providers, as for `serve`")
    t.add_argument("--onnx-dir", type=Path, default=None, help="exported ONNX graphs and TensorRT plans")
    t.add_argument("--t2w-idle-timeout", type=float, default=120.0,
                   help="seconds a token2wav stream may go without a chunk before it is freed, as for `serve` (counted "
                        "from its latest chunk's answer, only while token2wav runs no batch)")
    t.add_argument("--flow-cache-frames", type=int, default=None, metavar="N",
                   help="flow state frames kept per token2wav stream, as for `serve`")
    t.add_argument("--prompt-cache-mb", type=float, default=512.0, metavar="MB",
                   help="MB of voices' prompt frames token2wav keeps, as for `serve`")
    t.add_argument("--max-token-text-ratio", type=float, default=None, help=argparse.SUPPRESS)  # tests
    r = p.add_argument_group("supervision and shutdown")
    r.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM / Ctrl-C, how long requests in flight may take to finish")
    r.add_argument("--restart-delay", type=float, default=Backoff.initial_delay_s, metavar="S",
                   help="first wait before a dead tritonserver (or redis-server) is started again; doubles "
                        f"per failed attempt up to {Backoff.max_delay_s:g} s")
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
    supervisor = Supervisor({"tritonserver": server}, backoff(args), liveness={"tritonserver": Liveness(server)})
    print(f"starting tritonserver (log: {server.workdir / 'tritonserver.log'}) ...", file=out, flush=True)
    startup = TritonStartup(server, out, on_ready=supervisor.begin)
    codes: dict[str, int | None] = {}
    try:
        startup.begin()  # the gateway listens at once and answers 503 "starting" until Triton is ready
        lines = [f"  triton   grpc {server.grpc_url}, metrics {server.metrics_url} (starting: /readyz answers 503 "
                 f"until it is ready)", f"  voices   {voice_store}", f"  log      {server.log_path}"]
        code = run_gateway(args, (server.target,), model_dir, voice_store, lines, startup.gone, out, supervisor)
    finally:
        supervisor.close(lambda: codes.update(tritonserver=stop_running(server)))
        startup.stopped.set()
        print(f"tritonserver stopped (exit code {codes.get('tritonserver')})", file=out, flush=True)
        print_failed_stops({"tritonserver": server}, codes, out)
    return code or exit_code(codes)


def stop_running(server) -> int | None:
    """Stop `server`; its exit code, or None when it had died already (a restart was pending)."""
    running = server.is_running()
    code = server.stop()
    return code if running else None


def backoff(args: argparse.Namespace) -> Backoff:
    return Backoff(initial_delay_s=args.restart_delay)


def print_failed_stops(servers: dict, codes: dict[str, int | None], out: TextIO, lines: int = 12) -> None:
    """For each server that exited non-zero when stopped, the end of its log: tritonserver says there
    why (e.g. "Exit timeout expired": a model still loaded after --exit-timeout-secs)."""
    for name, code in codes.items():
        if code not in (0, None) and name in servers:
            print(f"{name} exited {code}; the end of its log ({servers[name].log_path}):\n"
                  f"{servers[name].log_tail(lines).rstrip()}", file=out, flush=True)


def exit_code(codes: dict[str, int | None]) -> int:
    """0 when every tritonserver exited 0 (all its models unloaded within its exit timeout), else 1."""
    return 0 if all(code in (0, None) for code in codes.values()) else 1


class TritonStartup:
    """tritonserver started in a thread, so the gateway answers (503 "starting") while it loads; a progress
    line every PROGRESS_EVERY_S (models loaded of the repository's, elapsed), one when it is ready."""

    def __init__(self, server, out: TextIO, on_ready=lambda: None):
        self.server, self.out, self.on_ready = server, out, on_ready
        self.finished = threading.Event()
        self.stopped = threading.Event()  # set once the server is stopped
        self.error: Exception | None = None

    def begin(self) -> None:
        threading.Thread(target=self._start, name="tritonserver-start", daemon=True).start()
        threading.Thread(target=self._report, name="tritonserver-progress", daemon=True).start()

    def gone(self) -> bool:
        """It failed to start (once started, a server that exits is the supervisor's to restart)."""
        return self.finished.is_set() and self.error is not None

    def _start(self) -> None:
        started = time.monotonic()
        try:
            self.server.start()
            print(f"tritonserver ready after {time.monotonic() - started:.0f} s: the gateway serves",
                  file=self.out, flush=True)
            self.on_ready()  # supervision from now on
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
    triton_port, grpc_port = official_ports(args)
    check_ports_free(args.host or "0.0.0.0", {"the gateway's port (--port)": _port(args.port),
                                              "the official gRPC port (--official-grpc-port)": _port(grpc_port),
                                              "the official Triton port (--official-triton-port)":
                                                  _port(triton_port)})
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
        raise ParameterError("split mode needs --frontends >= 1 and --backends >= 1")
    if args.voice_store:
        raise ParameterError("split mode shares voices through Redis: give --redis-url (or nothing: a local "
                         "redis-server is started), not --voice-store")
    model_dir = resolve_model_dir(args)
    run_dir = Path(args.run_dir) if args.run_dir else new_run_dir()
    options = serve_options(args, model_dir, args.redis_url)
    topology = SplitTopology(options, args.frontends, args.backends, run_dir, die_with_parent=True)
    print(f"starting {args.backends} backend and {args.frontends} frontend tritonservers (in {run_dir}) ...",
          file=out, flush=True)
    supervisor: Supervisor | None = None
    codes: dict[str, int | None] = {}
    try:
        topology.start()
        servers = {name: p for name, p in topology.processes().items() if isinstance(p, TritonProcess)}
        supervisor = Supervisor(topology.processes(), backoff(args),
                                liveness={name: Liveness(p) for name, p in servers.items()}).begin()
        targets = tuple(f.target for f in topology.frontends)
        lines = [*(f"  frontend grpc {f.grpc_url}, metrics {f.metrics_url} (pid {f.pid})" for f in topology.frontends),
                 *(f"  backend  grpc {b.grpc_url}, metrics {b.metrics_url} (pid {b.pid})" for b in topology.backends),
                 f"  voices   {topology.voice_store}", f"  layout   {run_dir / 'topology.json'}"]
        code = run_gateway(args, targets, model_dir, topology.voice_store, lines, lambda: False, out, supervisor)
    finally:
        if supervisor is not None:
            supervisor.close(lambda: codes.update(topology.stop()))
        else:
            codes.update(topology.stop())
        print("tritonservers stopped (exit codes: " + ", ".join(f"{n} {c}" for n, c in codes.items()) + ")",
              file=out, flush=True)
        print_failed_stops(topology.named_servers(), codes, out)
    return code or exit_code(codes)


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
                        max_queue_wait_s=args.max_queue_wait,  # the gateway's flag: one limit for both sides
                        realtime_margin=args.realtime_margin, realtime_capacity=args.realtime_capacity,
                        llm_max_batch=args.llm_max_batch, torch_threads=args.torch_threads,
                        llm_precision=args.llm_precision, flow_precision=args.flow_precision,
                        chunk_preset=args.chunk_preset, official_models=args.official_models,
                        engine=args.engine, precision=args.precision, ort_providers=args.ort_providers,
                        onnx_dir=args.onnx_dir,
                        max_text_chars=args.max_text_chars, max_token_text_ratio=args.max_token_text_ratio,
                        t2w_idle_timeout_s=args.t2w_idle_timeout,
                        flow_cache_frames=args.flow_cache_frames, prompt_cache_mb=args.prompt_cache_mb,
                        compile=args.compile, cuda_graphs=args.cuda_graphs)


def run_gateway(args, targets: tuple[TritonTarget, ...], model_dir: Path, voice_store: str, lines: list[str],
                servers_gone, out: TextIO, supervisor: Supervisor) -> int:
    """Serve the gateway in front of `targets` (plus any `--triton`) until Ctrl-C / SIGTERM (drained: 0)
    or until `servers_gone()` (1)."""
    from cosyvoice_triton.gateway.app import create_app

    from .state import DRAIN, READINESS_CHECKS

    extra, _ = split_triton_specs(args.triton)  # config_from_args keeps the dns:// ones
    config = config_from_args(args, triton=(*targets, *extra), model_dir=model_dir)
    config = dataclasses.replace(config, voice_store=voice_store)
    app = create_app(config)
    drain = app[DRAIN]
    app[READINESS_CHECKS].insert(0, lambda: supervision_readiness(supervisor))  # create_app's: the drain's
    app.cleanup_ctx.append(_process_metrics(supervisor, drain))
    note = f"\n  WARNING  {RANDOM_NOTE}" if is_random(model_dir) else ""
    print(f"cosyvoice-triton: serving {model_dir}{note}\n"
          f"  gateway  {config.url}   (POST /v1/tts, WS /v1/tts/ws, POST /v1/audio/speech, "
          f"/v1/voices, the official /inference_* and /v2/models/{config.synthesis_model}/infer)\n"
          f"  models   {config.synthesis_model}, {config.offline_model} ({config.family})\n" + "\n".join(lines)
          + "\nPress Ctrl-C to stop.", file=out, flush=True)
    return asyncio.run(serve_until_stopped(app, config.host, config.port, args.drain_timeout, out, servers_gone))


def supervision_readiness(supervisor: Supervisor) -> tuple[list[str], dict]:
    waits = [] if supervisor.ready() else [f"process {name}" for name in supervisor.waiting_for()]
    return waits, {"processes": supervisor.states()}


def _process_metrics(supervisor: Supervisor, drain):
    """cleanup_ctx: the supervisor's state and the drain on the gateway's /metrics."""
    from .state import METRICS

    async def register(app):
        app[METRICS].registry.register(ProcessCollector(supervisor, drain))
        yield

    return register


class ProcessCollector:
    """cosyvoice_gateway_process_up{process}, cosyvoice_gateway_process_restarts_total{process},
    cosyvoice_gateway_draining."""

    def __init__(self, supervisor: Supervisor, drain):
        self.supervisor, self.drain = supervisor, drain

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up_ = GaugeMetricFamily("cosyvoice_gateway_process_up", "1 while the supervised process runs",
                                labels=["process"])
        restarts = CounterMetricFamily("cosyvoice_gateway_process_restarts",
                                       "Times the supervised process was started again", labels=["process"])
        hangs = CounterMetricFamily("cosyvoice_gateway_process_hangs", "Times the supervised process was killed "
                                    "because its models stopped answering liveness probes", labels=["process"])
        for name, state in self.supervisor.states().items():
            up_.add_metric([name], 1.0 if state["state"] == "running" else 0.0)
            restarts.add_metric([name], state["restarts"])
            hangs.add_metric([name], state["hangs"])
        draining = GaugeMetricFamily("cosyvoice_gateway_draining", "1 once the gateway drains before it stops")
        draining.add_metric([], 1.0 if self.drain.draining else 0.0)
        yield from (up_, restarts, hangs, draining)

    def describe(self):
        return []
