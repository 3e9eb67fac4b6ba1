"""Addresses of Triton servers that a process talks to.

Used by the gateway (`--triton`, the servers it routes to) and by split-mode frontends (`--backend`, the
token2wav servers they call). A spec is one server, `grpc://host:port[?metrics=URL]` (or a bare
`host:port`), or a set found in DNS, `dns://name:port[?metrics_port=N]`: every address `name` resolves to
is one server (metrics on port+1 unless `metrics_port` says otherwise). The DNS form is for a Kubernetes
headless Service, whose name resolves to the ready pods: callers re-resolve it every few seconds, so
pods that the autoscaler adds or removes join and leave the pool. (A plain ClusterIP Service would hand
each long-lived gRPC connection to one pod, and per-server routing could not see the others.)
"""
from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class TritonTarget:
    """One Triton server: its gRPC address and the URL of its Prometheus metrics."""

    grpc: str  # host:port
    metrics_url: str

    @classmethod
    def parse(cls, spec: str, flag: str = "--triton") -> TritonTarget:
        """`grpc://host:port` (metrics at http://host:port+1/metrics, Triton's default layout), or
        `grpc://host:port?metrics=http://host:9002/metrics`, or a bare `host:port`."""
        text = spec.strip()
        if "://" not in text.split("?")[0]:  # a bare host:port (its query may hold a URL)
            text = "grpc://" + text
        parts = urlsplit(text)
        if parts.scheme != "grpc" or not parts.hostname or parts.port is None:
            raise ValueError(f"{flag} {spec!r}: expected grpc://host:port[?metrics=http://host:port/metrics]")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        metrics = parse_qs(parts.query).get("metrics", [None])[0]
        if metrics is None:
            metrics = f"http://{host}:{parts.port + 1}/metrics"
        return cls(grpc=f"{host}:{parts.port}", metrics_url=metrics)

    @property
    def name(self) -> str:
        return self.grpc

    @property
    def spec(self) -> str:
        """The text `parse` reads back into this target."""
        return f"grpc://{self.grpc}?metrics={self.metrics_url}"


Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP addresses


def resolve_ips(host: str, port: int) -> list[str]:
    """The IPv4 addresses of `host` (IPv6 when it has none), sorted; [] when it does not resolve."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
        except socket.gaierror:
            continue
        if infos:
            return sorted({info[4][0] for info in infos})
    return []


def is_discovery(spec: str) -> bool:
    return spec.strip().startswith("dns://")


def _dns_name(spec: str, flag: str) -> tuple[str, int, int]:
    """`dns://name:port[?metrics_port=N]` -> (name, port, metrics port)."""
    parts = urlsplit(spec.strip())
    if not parts.hostname or parts.port is None:
        raise ValueError(f"{flag} {spec!r}: expected dns://name:port[?metrics_port=N]")
    return parts.hostname, parts.port, int(parse_qs(parts.query).get("metrics_port", [parts.port + 1])[0])


def discover(specs: Sequence[str], flag: str = "--triton", resolve: Resolver = resolve_ips) -> list[TritonTarget]:
    """The servers `specs` name now: fixed ones as given, `dns://` ones as resolved (in spec order)."""
    targets: list[TritonTarget] = []
    for spec in specs:
        if not is_discovery(spec):
            targets.append(TritonTarget.parse(spec, flag))
            continue
        name, port, metrics_port = _dns_name(spec, flag)
        for ip in resolve(name, port):
            host = f"[{ip}]" if ":" in ip else ip
            targets.append(TritonTarget(grpc=f"{host}:{port}", metrics_url=f"http://{host}:{metrics_port}/metrics"))
    return list(dict.fromkeys(targets))


def check_spec(spec: str, flag: str = "--triton") -> None:
    """Raise ValueError for a spec that can never name a server (resolution is not attempted)."""
    if is_discovery(spec):
        _dns_name(spec, flag)
    else:
        TritonTarget.parse(spec, flag)
