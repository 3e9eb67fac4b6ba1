"""The gateway's Prometheus metrics (served at /metrics), one registry per application.

  cosyvoice_gateway_requests_total{route, status}       finished HTTP requests and WebSocket sessions
  cosyvoice_gateway_first_chunk_seconds{route}          histogram: request accepted -> first audio byte out
  cosyvoice_gateway_active_streams{route}               synthesis streams being sent
  cosyvoice_gateway_audio_seconds_total{route}          audio sent
  cosyvoice_gateway_errors_total{kind}                  errors by kind (invalid_input, unavailable, ...)
  cosyvoice_gateway_retries_total                       requests retried on another server before any audio
  cosyvoice_gateway_routed_total{server}                Triton calls sent to each server
  cosyvoice_gateway_server_healthy{server}              1 in the pool, 0 out
  cosyvoice_gateway_outstanding_cost{server}            this gateway's in-flight cost per server
  cosyvoice_gateway_server_inflight{server}             this gateway's in-flight requests per server
  cosyvoice_gateway_server_pending{server}              Triton's pending-request count (last scrape)

Servers come and go with DNS discovery: the per-server gauges are read from `router.servers` at each
scrape (a collector), so they list the pool's members now; `routed` drops a server's series when it
leaves the pool (`forget_server`, called by the router), so departed pods do not pile up.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .routing import Router

LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class _RouterCollector:
    def __init__(self, router: Router):
        self.router = router

    def collect(self):
        families = {
            "healthy": GaugeMetricFamily("cosyvoice_gateway_server_healthy", "1 if the server is in the pool",
                                         labels=["server"]),
            "cost": GaugeMetricFamily("cosyvoice_gateway_outstanding_cost",
                                      "Estimated cost of this gateway's requests in flight per server",
                                      labels=["server"]),
            "inflight": GaugeMetricFamily("cosyvoice_gateway_server_inflight",
                                          "This gateway's requests in flight per server", labels=["server"]),
            "pending": GaugeMetricFamily("cosyvoice_gateway_server_pending",
                                         "Triton's pending requests of the synthesis model (last scrape)",
                                         labels=["server"]),
        }
        for b in self.router.servers:
            families["healthy"].add_metric([b.name], 1.0 if b.healthy else 0.0)
            families["cost"].add_metric([b.name], b.outstanding_cost)
            families["inflight"].add_metric([b.name], b.inflight)
            families["pending"].add_metric([b.name], b.pending)
        yield from families.values()

    def describe(self):
        return []


class GatewayMetrics:
    def __init__(self, router: Router):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("cosyvoice_gateway_requests", "Finished requests", ["route", "status"],
                                registry=registry)
        self.first_chunk = Histogram("cosyvoice_gateway_first_chunk_seconds",
                                     "Seconds from accepting a synthesis request to its first audio byte",
                                     ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.active_streams = Gauge("cosyvoice_gateway_active_streams", "Synthesis streams being sent",
                                    ["route"], registry=registry)
        self.audio_seconds = Counter("cosyvoice_gateway_audio_seconds", "Seconds of audio sent", ["route"],
                                     registry=registry)
        self.errors = Counter("cosyvoice_gateway_errors", "Errors by kind", ["kind"], registry=registry)
        self.retries = Counter("cosyvoice_gateway_retries", "Requests retried on another server before any audio",
                               registry=registry)
        self.routed = Counter("cosyvoice_gateway_routed", "Triton calls sent per server", ["server"],
                              registry=registry)
        registry.register(_RouterCollector(router))
        for server in router.servers:
            self.routed.labels(server.name)

    def forget_server(self, server) -> None:
        try:
            self.routed.remove(server.name)
        except KeyError:  # never routed to
            pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
