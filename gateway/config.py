"""What a gateway is configured with, and the command-line flags that fill it.

```
config = GatewayConfig(triton=(TritonTarget.parse("grpc://127.0.0.1:8001"),), voice_store="redis://r:6379/0")
config = GatewayConfig(discovery=("dns://cosyvoice-frontend:8001",))   # Kubernetes
```
Servers come two ways (`--triton`, repeatable, either form): fixed ones (`triton`, `grpc://host:port`), which
stay in the pool for good, and DNS specs (`discovery`, `dns://name:port[?metrics_port=N]`), re-resolved every
`RoutingConfig.discovery_interval_s`: each address a name resolves to is one server, joining and leaving the
pool as the name's addresses change (see `routing.Router.rediscover`). The servers may be of both model
families: each one's family is learned from the server (`routing.Router.check`); `family` (the folder's of
--model-dir, else CosyVoice2) is the family of a request that names none while the servers serve several.

`add_gateway_arguments` / `config_from_args` are shared by `python -m cosyvoice_triton.gateway` (a
gateway in front of servers that run elsewhere) and `cosyvoice-triton up` (Triton and gateway together).
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from cosyvoice_triton.errors import ParameterError
from cosyvoice_triton.pipeline.audible import DEFAULT_THRESHOLD_DBFS
from cosyvoice_triton.targets import TritonTarget, check_spec, is_discovery
from cosyvoice_triton.wire.names import FAMILY_MODELS

log = logging.getLogger(__name__)

MiB = 1024 * 1024
STATIC_DIR = Path(__file__).resolve().parent / "static"
API_KEYS_ENV = "COSYVOICE_API_KEYS"  # comma-separated keys, added to --api-key-file's
ADMIN_KEYS_ENV = "COSYVOICE_ADMIN_KEYS"  # comma-separated admin keys, added to --admin-key-file's
# `up`'s ports for the official clients (docs/api/official.md): the official gRPC server's own default port,
# and one beside Triton's 8000-8002 for its Triton clients (whose default, 8001, is tritonserver's own).
OFFICIAL_TRITON_PORT = 8003
OFFICIAL_GRPC_PORT = 50000


@dataclass(frozen=True)
class Limits:
    max_text_chars: int = 2000  # per request; per WebSocket segment
    max_session_chars: int = 20000  # all text of one WebSocket session
    max_upload_bytes: int = 10 * MiB  # request bodies (413 beyond), WebSocket messages
    max_streams_per_key: int = 8  # concurrent synthesis streams per API key; 429 beyond
    max_keyless_streams: int = 32  # without keys: concurrent streams of all callers together; 429 beyond
    requests_per_second: float = 50.0  # per key (keyless: all callers together); 429 + Retry-After; 0: off
    request_burst: int = 100
    registrations_per_minute: float = 60.0  # POST /v1/voices per key (keyless: together); 0: off
    registration_burst: int = 20
    ws_idle_timeout_s: float = 60.0  # a WebSocket with no client message and nothing in flight is closed
    ws_session_timeout_s: float = 1800.0  # longest WebSocket session


@dataclass(frozen=True)
class RoutingConfig:
    health_interval_s: float = 2.0  # ServerReady + ModelReady(cosyvoice2) per server
    health_timeout_s: float = 2.0
    metrics_interval_s: float = 2.0  # scrape of each server's pending-request metric
    first_chunk_timeout_s: float = 60.0  # a stream with no audio by then fails (and is retried elsewhere)
    chunk_timeout_s: float = 60.0  # longest wait between two chunks once audio flows
    register_timeout_s: float = 60.0
    offline_timeout_s: float = 300.0  # a non-streamed request: the whole audio in one call to the offline model
    max_attempts: int = 3  # servers tried for a request that fails before its first byte
    max_queue_wait_s: float = 2.0  # admission: a request no server would start this soon gets 503 at once
    discovery_interval_s: float = 10.0  # re-resolution of the dns:// specs (GatewayConfig.discovery)


@dataclass(frozen=True)
class GatewayConfig:
    triton: tuple[TritonTarget, ...] = ()  # fixed servers: members for good (in rotation while healthy)
    discovery: tuple[str, ...] = ()  # dns://name:port[?metrics_port=N] specs: their addresses come and go
    host: str = "0.0.0.0"
    port: int = 8080
    voice_store: str | None = None  # sqlite path or redis:// url; None: $COSYVOICE_HOME/voices.sqlite
    model_dir: Path | None = None  # its tokenizer counts text tokens for cost estimates (else a byte count)
    api_keys: frozenset[str] = frozenset()  # empty (and no admin keys): no authentication
    admin_keys: frozenset[str] = frozenset()  # keys that may also register and delete shared voices
    limits: Limits = field(default_factory=Limits)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    home: Path | None = None  # where the default voice's prompt wav is written; None: $COSYVOICE_HOME
    default_voice: bool = True  # register voice "default" at start when the store lacks it
    access_log: bool = True  # one line per request on stderr (gateway/access_log.py)
    audible_threshold_dbfs: float = DEFAULT_THRESHOLD_DBFS  # first audible audio: a 10 ms window above it (pipeline/audible.py)
    ws_heartbeat_s: float = 30.0
    ws_pipeline_depth: int = 2  # WebSocket segments synthesized ahead of the one being sent
    shutdown_timeout_s: float = 10.0
    static_dir: Path = STATIC_DIR
    # The synthesis models of the configured family (`family_models`): a request names none goes to it when the
    # servers serve several families (each other family's are the ones its servers name, wire/names.py)
    synthesis_model: str = "cosyvoice2"
    offline_model: str = "cosyvoice2_offline"  # non-streamed requests: one full-attention flow pass per sentence
    register_model: str = "register_voice"
    sample_rate: int = 24000
    official_grpc_port: int | None = None  # the official gRPC API (official_grpc.py) here (0: a free port); None: off
    official_triton_port: int | None = None  # Triton's gRPC protocol (triton_facade.py) (0: a free port); None: off

    @property
    def family(self) -> str:
        """The configured model family, the one the synthesis model is named for (cosyvoice2, cosyvoice3)."""
        return next((family for family, models in FAMILY_MODELS.items() if self.synthesis_model in models),
                    self.synthesis_model)  # a model of another name: its own

    @property
    def models(self) -> dict[str, tuple[str, str]]:
        """The configured family's (streaming, offline) synthesis models, as configured."""
        return {self.family: (self.synthesis_model, self.offline_model)}

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the gateway (a wildcard host is reached on 127.0.0.1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def __post_init__(self):
        if not self.triton and not self.discovery:
            raise ParameterError("at least one Triton server is needed (--triton grpc://host:port or dns://name:port)")
        for spec in self.discovery:
            if not is_discovery(spec):
                raise ParameterError(f"discovery {spec!r}: expected dns://name:port[?metrics_port=N]")
            check_spec(spec)
        if self.official_grpc_port is not None and not 0 <= self.official_grpc_port <= 65535:
            raise ParameterError(f"--official-grpc-port {self.official_grpc_port}: expected 0 (a free port) to 65535")
        if self.official_triton_port is not None and not 0 <= self.official_triton_port <= 65535:
            raise ParameterError(f"--official-triton-port {self.official_triton_port}: expected 0 (a free port) to 65535")


def add_gateway_arguments(parser: argparse.ArgumentParser, *, triton_help: str | None = None,
                          official_ports: bool = False) -> None:
    """The gateway's flags. `official_ports`: the official clients' ports are on by default (OFFICIAL_TRITON_PORT,
    OFFICIAL_GRPC_PORT), with --no-official-ports to close both (`up`); else off unless given."""
    g = parser.add_argument_group("gateway")
    g.add_argument("--triton", action="append", default=[], metavar="URL",
                   help=triton_help or "a Triton server, grpc://host:port[?metrics=URL] (metrics default: "
                                       "port + 1), or every address a DNS name resolves to, "
                                       "dns://name:port[?metrics_port=N] (re-resolved every --discovery-interval "
                                       "seconds; a Kubernetes headless Service); repeat for several "
                                       "(default grpc://127.0.0.1:8001)")
    g.add_argument("--host", default="0.0.0.0", help="address the gateway listens on")
    g.add_argument("--port", type=int, default=8080, help="the gateway's port (default %(default)s)")
    grpc_default, triton_default = (OFFICIAL_GRPC_PORT, OFFICIAL_TRITON_PORT) if official_ports else (None, None)
    g.add_argument("--official-grpc-port", type=int, default=grpc_default, metavar="PORT",
                   help="also serve the official CosyVoice gRPC API (cosyvoice.CosyVoice/Inference) on PORT, on the "
                        "gateway's host, with its keys and limits (0: a free port, printed at start; default: "
                        f"{grpc_default or 'off'})")
    g.add_argument("--official-triton-port", type=int, default=triton_default, metavar="PORT",
                   help="also speak Triton's gRPC protocol on PORT, for the official Triton clients (client_grpc.py "
                        "--model-name cosyvoice2): their requests go to cosyvoice2_official*, the rest is passed on "
                        f"unchanged (0: a free port, printed at start; default: {triton_default or 'off'}). They send "
                        "no API key")
    if official_ports:
        g.add_argument("--no-official-ports", action="store_true",
                       help="open neither of the two ports above (the official HTTP routes stay on --port)")
    g.add_argument("--redis-url", default=None, help="share voices through Redis (redis://host:port/db)")
    g.add_argument("--voice-store", default=None,
                   help="SQLite file of the voice store (default: $COSYVOICE_HOME/voices.sqlite)")
    g.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                   help=f"accept the API keys in FILE, one a line (repeatable; also ${API_KEYS_ENV}, "
                        "comma-separated); none: no authentication")
    g.add_argument("--admin-key-file", action="append", default=[], metavar="FILE",
                   help=f"admin keys (also ${ADMIN_KEYS_ENV}): may register and delete shared voices")
    g.add_argument("--api-key", action="append", default=[],
                   help="accept this API key: deprecated, `ps` shows it; use --api-key-file or the environment")
    g.add_argument("--max-text-chars", type=int, default=Limits.max_text_chars,
                   help="longest text of one request or WebSocket segment, in characters (default %(default)s)")
    g.add_argument("--max-upload-mb", type=float, default=Limits.max_upload_bytes / MiB,
                   help="largest uploaded recording or WebSocket message, in MiB (default %(default)g)")
    g.add_argument("--max-streams-per-key", type=int, default=Limits.max_streams_per_key,
                   help="concurrent synthesis streams per API key; 429 beyond (default %(default)s)")
    g.add_argument("--max-keyless-streams", type=int, default=Limits.max_keyless_streams,
                   help="without keys: concurrent streams of all callers together")
    g.add_argument("--requests-per-second", type=float, default=Limits.requests_per_second,
                   help="per key (keyless: all callers together), bursts of twice that; 0: no limit")
    g.add_argument("--registrations-per-minute", type=float, default=Limits.registrations_per_minute,
                   help="voice registrations per key (keyless: together); 0: no limit")
    g.add_argument("--ws-idle-timeout", type=float, default=Limits.ws_idle_timeout_s, metavar="S",
                   help="close a WebSocket with no client message and nothing in flight for S seconds")
    g.add_argument("--ws-session-timeout", type=float, default=Limits.ws_session_timeout_s, metavar="S",
                   help="close a WebSocket session after S seconds in all (default %(default)g)")
    g.add_argument("--health-interval", type=float, default=RoutingConfig.health_interval_s, metavar="S",
                   help="seconds between readiness checks of each Triton server (default %(default)g)")
    g.add_argument("--first-chunk-timeout", type=float, default=RoutingConfig.first_chunk_timeout_s, metavar="S",
                   help="a stream with no audio after S seconds fails and is tried on another server "
                        "(default %(default)g)")
    g.add_argument("--max-queue-wait", type=float, default=RoutingConfig.max_queue_wait_s, metavar="S",
                   help="admission: refuse (503 + Retry-After) a request that no server would start within S "
                        "seconds (cosyvoice_triton/admission.py)")
    g.add_argument("--discovery-interval", type=float, default=RoutingConfig.discovery_interval_s, metavar="S",
                   help="seconds between re-resolutions of dns:// servers")
    g.add_argument("--no-default-voice", action="store_true", help="do not register voice 'default' at start")
    g.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no per-request line (method, route, status, first-chunk ms, audio seconds) on stderr")
    g.add_argument("--audible-threshold-dbfs", type=float, default=DEFAULT_THRESHOLD_DBFS, metavar="DB",
                   help="first audible audio (metrics, access log, WebSocket end message): the first 10 ms window "
                        "whose RMS is above DB dBFS (default %(default)g)")


def official_ports(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(--official-triton-port, --official-grpc-port); both None (off) with --no-official-ports."""
    if getattr(args, "no_official_ports", False):
        return None, None
    return args.official_triton_port, args.official_grpc_port


def voice_store_url(args: argparse.Namespace) -> str | None:
    if args.redis_url and args.voice_store:
        raise ParameterError("give --redis-url or --voice-store, not both")
    return args.redis_url or args.voice_store


def api_keys(args: argparse.Namespace) -> frozenset[str]:
    """--api-key-file's keys, $COSYVOICE_API_KEYS, and (with a warning) --api-key."""
    if args.api_key:
        log.warning("--api-key puts keys on the command line, where `ps` shows them: use --api-key-file or "
                    "$%s", API_KEYS_ENV)
    return _keys(args.api_key_file, API_KEYS_ENV) | frozenset(args.api_key)


def admin_keys(args: argparse.Namespace) -> frozenset[str]:
    return _keys(args.admin_key_file, ADMIN_KEYS_ENV)


def read_key_file(path: str) -> frozenset[str]:
    """Keys from a file: one a line; blank lines and lines starting with # are skipped."""
    with open(path, encoding="utf-8") as file:
        lines = (line.strip() for line in file)
        return frozenset(line for line in lines if line and not line.startswith("#"))


def _keys(files: list[str], env: str) -> frozenset[str]:
    keys = {k.strip() for k in os.environ.get(env, "").split(",") if k.strip()}
    for path in files:
        keys |= read_key_file(path)
    return frozenset(keys)


def split_triton_specs(specs: list[str]) -> tuple[tuple[TritonTarget, ...], tuple[str, ...]]:
    """`--triton` values -> (fixed servers, dns:// specs), each checked (ValueError names the bad one)."""
    for spec in specs:
        try:
            check_spec(spec)
        except ValueError as exc:  # e.g. a metrics_port that is not a number: say which value
            raise ParameterError(str(exc) if spec in str(exc) else f"--triton {spec!r}: {exc}") from None
    fixed = tuple(TritonTarget.parse(s) for s in specs if not is_discovery(s))
    return fixed, tuple(s.strip() for s in specs if is_discovery(s))


def config_from_args(args: argparse.Namespace, triton: tuple[TritonTarget, ...] | None = None,
                     model_dir: Path | None = None) -> GatewayConfig:
    """`triton`: the fixed servers, when the caller chose them (`up`); the dns:// specs of `--triton` still count."""
    fixed, discovery = split_triton_specs(args.triton or ["grpc://127.0.0.1:8001"])
    if triton is None:
        triton = fixed
    if args.discovery_interval <= 0:
        raise ParameterError("--discovery-interval must be positive")
    routing = RoutingConfig(health_interval_s=args.health_interval, first_chunk_timeout_s=args.first_chunk_timeout,
                            max_queue_wait_s=args.max_queue_wait,
                            discovery_interval_s=args.discovery_interval)
    limits = Limits(max_text_chars=args.max_text_chars, max_upload_bytes=int(args.max_upload_mb * MiB),
                    max_streams_per_key=args.max_streams_per_key, max_keyless_streams=args.max_keyless_streams,
                    requests_per_second=args.requests_per_second,
                    request_burst=max(1, int(2 * args.requests_per_second)),
                    registrations_per_minute=args.registrations_per_minute,
                    ws_idle_timeout_s=args.ws_idle_timeout, ws_session_timeout_s=args.ws_session_timeout)
    model_dir = model_dir if model_dir is not None else getattr(args, "model_dir", None)
    synthesis_model, offline_model = family_models(Path(model_dir) if model_dir else None)
    triton_port, grpc_port = official_ports(args)
    return GatewayConfig(triton=triton, discovery=discovery, host=args.host, port=args.port,
                         voice_store=voice_store_url(args),
                         model_dir=Path(model_dir) if model_dir else None, api_keys=api_keys(args),
                         admin_keys=admin_keys(args),
                         limits=limits, routing=routing, default_voice=not args.no_default_voice,
                         access_log=getattr(args, "access_log", True),
                         audible_threshold_dbfs=args.audible_threshold_dbfs,
                         official_grpc_port=grpc_port, official_triton_port=triton_port,
                         synthesis_model=synthesis_model, offline_model=offline_model)


def family_models(model_dir: Path | None) -> tuple[str, str]:
    """The streaming and offline synthesis models of the family of `model_dir` (its yaml decides), as the servers
    of that folder name them; CosyVoice2's without a folder."""
    from cosyvoice_triton.family import COSYVOICE2, family_of

    family = family_of(model_dir) if model_dir is not None and model_dir.is_dir() else COSYVOICE2
    streaming, offline = FAMILY_MODELS[family.name][:2]
    return streaming, offline
