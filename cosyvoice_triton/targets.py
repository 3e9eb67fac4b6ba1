"""Addresses of Triton servers that a process talks to: `grpc://host:port[?metrics=URL]`.

Used by the gateway (`--triton`, the servers it routes to) and by split-mode frontends (`--backend`, the
token2wav servers they call).
"""
from __future__ import annotations

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
