"""What a benchmark run talks to: an endpoint given on the command line, or a tritonserver started for the
run (through the launcher, on free ports), with a gateway in this process in front of it for the `http`
and `ws` paths.

```
with deployment(settings, run_dir, {"llm_max_batch": 1}) as endpoint:
    levels = loadgen.measure(endpoint.target, cases, [1, 2], 4)
```
`server_overrides` are `ServeOptions` fields (a comparison varies them); a deployment of an endpoint
given on the command line cannot honour them and refuses any.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_triton.perf import loadgen

QUICK_RATIO = 3.0  # --quick: the random LLM stops after at most 3 speech tokens per text token
# The bench's clients wait this long; a gateway started here must not give up on a stream earlier.
CLIENT_TIMEOUT_S = 600.0  # default deadline of one request (`bench --request-timeout-s`)
# A server's first start may export ONNX graphs or build TensorRT plans (`--compare engine`).
STARTUP_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Settings:
    """The command-line choices that decide where requests go."""

    path: str  # grpc | http | ws
    start: bool  # start a tritonserver (and, for http/ws, a gateway) here
    url: str | None = None  # with start=False: host:port (grpc) or the gateway's base URL
    api_key: str | None = None
    model_dir: str | None = None
    device: str = "cpu"
    torch_threads: int = 0
    quick: bool = False
    token_text_ratio: float | None = None  # with start: the LLM's cap on speech tokens per text token
    max_concurrency: int = 16  # sizes the started gateway's per-client stream limit
    request_timeout_s: float = CLIENT_TIMEOUT_S  # the client's deadline for one whole request


@dataclass(frozen=True)
class Endpoint:
    path: str
    url: str
    api_key: str | None = None
    server_version: str | None = None  # "triton 2.x" when the tool can ask
    server_log: Path | None = None  # the started server's log
    request_timeout_s: float = CLIENT_TIMEOUT_S

    def target(self):
        """A new loadgen target for this endpoint (make it inside the event loop that will use it)."""
        return loadgen.make_target(self.path, self.url, self.api_key, timeout_s=self.request_timeout_s)

    def describe(self) -> str:
        return f"{'triton grpc' if self.path == 'grpc' else 'gateway ' + self.path} {self.url}"


def serve_options(settings: Settings, run_dir: Path, server_overrides: dict | None = None):
    """`ServeOptions` of a server started for the run: free ports, its own voice store in `run_dir`."""
    from cosyvoice_triton.server.launcher import ServeOptions

    options = ServeOptions(model_dir=settings.model_dir, run_dir=run_dir, address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, device=settings.device,
                           voice_store=str(run_dir / "voices.sqlite"),
                           max_token_text_ratio=settings.token_text_ratio or (QUICK_RATIO if settings.quick else None),
                           torch_threads=settings.torch_threads, startup_timeout_s=STARTUP_TIMEOUT_S)
    return dataclasses.replace(options, **(server_overrides or {}))


@contextmanager
def started_server(options) -> Iterator:
    """A tritonserver on `options` (a `ServeOptions`), stopped when the block ends."""
    from cosyvoice_triton.server.launcher import prepare

    server = prepare(options, die_with_parent=True)
    print(f"starting tritonserver (log {server.log_path}) ...", file=sys.stderr, flush=True)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def gateway_config(server, options, max_concurrency: int, timeout_s: float = CLIENT_TIMEOUT_S):
    """A gateway in front of `server` (started on `options`) alone, sharing its voice store, with limits
    that leave the measurement to the server: the bench is its only client."""
    from cosyvoice_triton.gateway.config import GatewayConfig, Limits, RoutingConfig
    from cosyvoice_triton.targets import TritonTarget

    return GatewayConfig(triton=(TritonTarget(server.grpc_url, server.metrics_url),), host="127.0.0.1", port=0,
                         voice_store=options.voice_store, home=Path(options.run_dir) / "gateway",
                         default_voice=False,
                         limits=Limits(max_streams_per_key=max(8, 2 * max_concurrency)),
                         routing=RoutingConfig(health_interval_s=1.0, metrics_interval_s=1.0,
                                               first_chunk_timeout_s=timeout_s, chunk_timeout_s=timeout_s))


@contextmanager
def started_gateway(config) -> Iterator:
    """The gateway of `config` served from a thread of this process, ready; stopped when the block ends."""
    from cosyvoice_triton.gateway.testing import GatewayThread

    with GatewayThread(config) as gateway:
        gateway.wait_ready()
        print(f"gateway in this process at {gateway.url}", file=sys.stderr, flush=True)
        yield gateway


def server_version(grpc_url: str) -> str | None:
    try:
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(grpc_url) as client:
            meta = client.get_server_metadata()
            return f"{meta.name} {meta.version}"
    except Exception:  # noqa: BLE001 - informative only
        return None


@contextmanager
def deployment(settings: Settings, run_dir: Path, server_overrides: dict | None = None) -> Iterator[Endpoint]:
    """The endpoint of `settings`: the given one, or a server (and gateway) started in `run_dir`."""
    if not settings.start:
        if server_overrides:
            raise ValueError(f"{', '.join(sorted(server_overrides))} can only vary on a server started here "
                             "(--start)")
        version = server_version(settings.url) if settings.path == "grpc" else None
        yield Endpoint(settings.path, settings.url, settings.api_key, server_version=version,
                       request_timeout_s=settings.request_timeout_s)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    options = serve_options(settings, run_dir, server_overrides)
    with started_server(options) as server:
        version, log = server_version(server.grpc_url), server.log_path
        if settings.path == "grpc":
            yield Endpoint("grpc", server.grpc_url, server_version=version, server_log=log,
                           request_timeout_s=settings.request_timeout_s)
            return
        config = gateway_config(server, options, settings.max_concurrency, settings.request_timeout_s)
        with started_gateway(config) as gateway:
            yield Endpoint(settings.path, gateway.url, server_version=version, server_log=log,
                           request_timeout_s=settings.request_timeout_s)


def engine_warnings(log_path: Path | None) -> list[str]:
    """The server log's lines about an engine that could not run and fell back (see engines/select.py)."""
    if log_path is None or not log_path.exists():
        return []
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    # Triton's prefix ("W1130 02:19:29.72 1872 logs.py:38] ") differs per line; the message repeats per instance.
    messages = {line.split("] ", 1)[-1].strip().strip('"') for line in lines}
    return sorted(m for m in messages if "is not available on" in m and "using" in m)
