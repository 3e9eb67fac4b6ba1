"""The gateway's Prometheus metrics (served at /metrics), one registry per application; the names and what each
counts: docs/operations/metrics.md#every-metric. The per-server gauges are read from `router.servers` at each
scrape, and `routed` drops a server's series when it leaves the pool, so departed pods do not pile up.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from cosyvoice_triton.admission import estimate_wait

from .admission import server_load
from .routing import Router

LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


# Per-server gauges: (metric name, help, the value of one pool member). The wait is read from the router.
SERVER_GAUGES = (
    ("cosyvoice_gateway_server_healthy", "1 if the server is in the pool",
     lambda server, router: 1.0 if server.healthy else 0.0),
    ("cosyvoice_gateway_outstanding_cost", "Estimated cost of this gateway's requests in flight per server",
     lambda server, router: server.outstanding_cost),
    ("cosyvoice_gateway_server_inflight", "This gateway's requests in flight per server",
     lambda server, router: server.inflight),
    ("cosyvoice_gateway_server_pending", "Triton's pending requests of the synthesis model (last scrape)",
     lambda server, router: server.pending),
    ("cosyvoice_gateway_server_queued", "Requests admitted by the server, waiting for a worker (last scrape)",
     lambda server, router: server.queued),
    ("cosyvoice_gateway_server_slots", "Streams the server runs at once (last scrape; 0: not scraped yet)",
     lambda server, router: server.slots),
    ("cosyvoice_gateway_server_capacity_audio_seconds_per_second",
     "Audio seconds per second the server makes, all streams together (last scrape; 0: not scraped yet)",
     lambda server, router: server.capacity),
    ("cosyvoice_gateway_server_realtime_slots", "Streams the server keeps ahead of their listeners (last scrape)",
     lambda server, router: server.realtime_slots),
    ("cosyvoice_gateway_server_expected_wait_seconds", "Admission's estimated wait for a new request on the server now",
     lambda server, router: _expected_wait(server, router)),
    ("cosyvoice_gateway_llm_free_slots", "The server's free LLM KV-cache slots (last scrape)",
     lambda server, router: server.llm_free_slots),
    ("cosyvoice_gateway_token2wav_pending", "Chunks waiting in the server's token2wav queue (last scrape)",
     lambda server, router: server.token2wav_pending),
)


def _expected_wait(server, router: Router) -> float:
    load = server_load(server, router.mean_cost)
    return 0.0 if load is None else estimate_wait(load)


class _RouterCollector:
    def __init__(self, router: Router):
        self.router = router

    def collect(self):
        for name, help_text, value_of in SERVER_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["server"])
            for server in self.router.servers:
                family.add_metric([server.name], value_of(server, self.router))
            yield family

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
        self.first_audible = Histogram("cosyvoice_gateway_first_audible_seconds",
                                       "Seconds from accepting a synthesis request to sending the chunk that holds "
                                       "its first audible sample (a 10 ms window above the audible threshold)",
                                       ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.active_streams = Gauge("cosyvoice_gateway_active_streams", "Synthesis streams being sent",
                                    ["route"], registry=registry)
        self.audio_seconds = Counter("cosyvoice_gateway_audio_seconds", "Seconds of audio sent", ["route"],
                                     registry=registry)
        self.errors = Counter("cosyvoice_gateway_errors", "Errors by kind", ["kind"], registry=registry)
        self.retries = Counter("cosyvoice_gateway_retries", "Requests retried on another server before any audio",
                               registry=registry)
        self.refused = Counter("cosyvoice_gateway_refused", "Requests refused by admission (503 + Retry-After)",
                               ["where"], registry=registry)
        for where in ("gateway", "server"):
            self.refused.labels(where)
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
