"""DNS discovery of Triton servers in the gateway (`--triton dns://name:port`).

Config parsing; then the router's membership with a scripted resolver and fake clients (no servers):
servers join (after a first health check) and leave (at once from the pool, their channel closed once
their last request ends); a failing or empty lookup keeps the pool; fixed servers never leave. Then a real
gateway (`GatewayThread`) in front of two stand-in gRPC servers that answer only the readiness calls, on
127.0.0.1 and 127.0.0.2 with one port (as pods behind a headless Service): it starts with nothing
resolved, becomes ready when DNS names them, and follows DNS through its discovery loop. A gateway over
two real tritonservers whose DNS drops one of them is in test_gateway_routing.py.
"""
from __future__ import annotations

import argparse
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cosyvoice_triton import __version__
from cosyvoice_triton.gateway.__main__ import main as gateway_main
from cosyvoice_triton.gateway.config import (
    GatewayConfig,
    RoutingConfig,
    add_gateway_arguments,
    config_from_args,
)
from cosyvoice_triton.errors import Unavailable
from cosyvoice_triton.gateway.metrics import GatewayMetrics
from cosyvoice_triton.gateway.routing import Router
from cosyvoice_triton.gateway.state import ROUTER
from cosyvoice_triton.server_pool import Server
from cosyvoice_triton.targets import TritonTarget
from cosyvoice_triton.gateway.testing import GatewayThread
from polling import wait_until
from triton_harness import metric_value, scrape
from tritonclient.grpc import service_pb2, service_pb2_grpc

pytestmark = pytest.mark.timeout(120)

SPEC = "dns://tts.test:8001"
WAIT_S = 30.0  # for a gateway to see what changed


# ---- config -------------------------------------------------------------------------------------------

def parse(*argv: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_triton_flags_split_into_fixed_servers_and_dns_specs():
    config = parse("--triton", "grpc://a:8001", "--triton", "dns://frontend:8001?metrics_port=9100",
                   "--triton", "b:7001", "--discovery-interval", "3")
    assert config.triton == (TritonTarget("a:8001", "http://a:8002/metrics"),
                             TritonTarget("b:7001", "http://b:7002/metrics"))
    assert config.discovery == ("dns://frontend:8001?metrics_port=9100",)
    assert config.routing.discovery_interval_s == 3
    dns_only = parse("--triton", SPEC)
    assert dns_only.triton == () and dns_only.discovery == (SPEC,)
    assert dns_only.routing.discovery_interval_s == RoutingConfig.discovery_interval_s
    assert parse().triton == (TritonTarget.parse("grpc://127.0.0.1:8001"),) and parse().discovery == ()


@pytest.mark.parametrize("bad", ["dns://frontend", "dns://:8001", "dns://frontend:8001?metrics_port=x",
                                 "http://frontend:8001"])
def test_a_bad_spec_is_an_error_at_start(bad, capsys):
    with pytest.raises(ValueError, match="--triton"):
        parse("--triton", "grpc://a:8001", "--triton", bad)
    with pytest.raises(SystemExit) as exit_:
        gateway_main(["--triton", bad])
    assert exit_.value.code == 2 and bad in capsys.readouterr().err


def test_config_needs_a_server_or_a_dns_spec():
    with pytest.raises(ValueError, match="at least one Triton server"):
        GatewayConfig()
    with pytest.raises(ValueError, match="dns://"):
        GatewayConfig(discovery=("grpc://a:8001",))
    with pytest.raises(ValueError):
        parse("--triton", SPEC, "--discovery-interval", "0")
    assert GatewayConfig(discovery=(SPEC,)).triton == ()


# ---- the router with a scripted resolver -------------------------------------------------------------------

class Dns:
    """A resolver whose answers the test sets: addresses or an exception, by the name's first label."""

    def __init__(self, **answers):
        self.answers = answers
        self.lookups = 0
        self._lock = threading.Lock()  # lookups run in a worker thread

    def __call__(self, host: str, port: int) -> list[str]:
        with self._lock:
            self.lookups += 1
            answer = self.answers.get(host.split(".")[0], [])
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


class FakeClient:
    def __init__(self, url: str, servers: FakeServers):
        self.url, self.servers, self.closed = url, servers, False

    async def ready(self, model: str, timeout_s: float) -> bool:
        if self.servers.hold is not None:  # a server slow to answer
            await self.servers.hold.wait()
        assert not self.closed, "a health check on a closed channel"
        return self.url in self.servers.ready

    async def close(self) -> None:
        self.closed = True


class FakeServers:
    """Makes the router's clients; `ready` holds the addresses whose health check passes."""

    def __init__(self, *ready: str):
        self.ready = set(ready)
        self.clients: list[FakeClient] = []
        self.hold: asyncio.Event | None = None  # set: health checks wait for it

    def __call__(self, url: str) -> FakeClient:
        self.clients.append(FakeClient(url, self))
        return self.clients[-1]

    def client(self, url: str) -> FakeClient:
        return next(c for c in reversed(self.clients) if c.url == url)


def dns_router(dns: Dns, servers: FakeServers, fixed: tuple[str, ...] = (), specs=(SPEC,)) -> Router:
    backends = [Server(TritonTarget.parse(f), servers(TritonTarget.parse(f).grpc)) for f in fixed]
    return Router(backends, RoutingConfig(), "cosyvoice2", discovery=specs, resolve=dns, new_client=servers)


def members(router: Router) -> dict[str, bool]:
    return {b.name: b.healthy for b in router.servers}


def test_servers_join_after_their_first_health_check():
    async def scenario():
        dns, servers = Dns(tts=["10.0.0.1", "10.0.0.2"]), FakeServers("10.0.0.1:8001")
        router = dns_router(dns, servers)
        assert router.servers == [] and router.healthy() == []
        with pytest.raises(Unavailable):
            router.pick()
        await router.rediscover()
        assert members(router) == {"10.0.0.1:8001": True, "10.0.0.2:8001": False}  # checked at once
        assert router.servers[1].target.metrics_url == "http://10.0.0.2:8002/metrics"
        assert {router.pick().name for _ in range(3)} == {"10.0.0.1:8001"}
        servers.ready.add("10.0.0.2:8001")
        await router.check_all()
        assert {router.pick().name for _ in range(2)} == {"10.0.0.1:8001", "10.0.0.2:8001"}
        await router.rediscover()  # the same answer: nothing changes, no new clients
        assert len(servers.clients) == 2 and members(router) == {"10.0.0.1:8001": True, "10.0.0.2:8001": True}
        await router.close()
        assert all(c.closed for c in servers.clients)

    asyncio.run(scenario())


def test_a_server_gone_from_dns_leaves_at_once_and_closes_after_its_last_request():
    async def scenario():
        dns, servers = Dns(tts=["10.0.0.1", "10.0.0.2"]), FakeServers("10.0.0.1:8001", "10.0.0.2:8001")
        router = dns_router(dns, servers)
        left = []
        router.on_leave = left.append
        await router.rediscover()
        b = router.servers[1]
        dns.answers["tts"] = ["10.0.0.1"]
        with router.lease(b, 100.0):  # a request still streaming from the server that goes
            await router.rediscover()
            await asyncio.sleep(0)
            assert members(router) == {"10.0.0.1:8001": True} and left == [b]
            assert {router.pick().name for _ in range(3)} == {"10.0.0.1:8001"}
            await router.check_all()
            assert not servers.client("10.0.0.2:8001").closed  # its request still needs the channel
        await asyncio.sleep(0)  # the close runs as a task
        await router.check_all()  # waits for it (closes and checks exclude each other)
        assert servers.client("10.0.0.2:8001").closed and not servers.client("10.0.0.1:8001").closed

        # Back in DNS later (a pod that was unready): a new member with a new channel.
        dns.answers["tts"] = ["10.0.0.1", "10.0.0.2"]
        await router.rediscover()
        assert members(router) == {"10.0.0.1:8001": True, "10.0.0.2:8001": True}
        assert not servers.client("10.0.0.2:8001").closed
        await router.close()

    asyncio.run(scenario())


def test_an_idle_server_gone_from_dns_is_closed_right_away():
    async def scenario():
        dns, servers = Dns(tts=["10.0.0.1", "10.0.0.2"]), FakeServers("10.0.0.1:8001", "10.0.0.2:8001")
        router = dns_router(dns, servers)
        await router.rediscover()
        dns.answers["tts"] = ["10.0.0.2", "10.0.0.3"]  # one pod replaced by another
        await router.rediscover()
        assert members(router) == {"10.0.0.2:8001": True, "10.0.0.3:8001": False}
        await router.check_all()
        assert servers.client("10.0.0.1:8001").closed
        await router.close()

    asyncio.run(scenario())


def test_a_channel_is_not_closed_under_a_running_health_check():
    async def scenario():
        dns, servers = Dns(tts=["10.0.0.1", "10.0.0.2"]), FakeServers("10.0.0.1:8001", "10.0.0.2:8001")
        router = dns_router(dns, servers)
        await router.rediscover()
        servers.hold = asyncio.Event()
        checks = asyncio.create_task(router.check_all())
        await asyncio.sleep(0)  # both checks wait for their answers
        dns.answers["tts"] = ["10.0.0.1"]
        await router.rediscover()
        await asyncio.sleep(0)
        assert members(router) == {"10.0.0.1:8001": True} and not servers.client("10.0.0.2:8001").closed
        servers.hold.set()
        await checks  # FakeClient.ready fails if its channel was closed while it waited
        await asyncio.sleep(0)
        assert servers.client("10.0.0.2:8001").closed
        await router.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("hiccup", [[], OSError("resolver down")], ids=["nothing", "error"])
def test_a_failed_or_empty_lookup_keeps_the_pool(hiccup):
    async def scenario():
        dns, servers = Dns(tts=["10.0.0.1", "10.0.0.2"]), FakeServers("10.0.0.1:8001", "10.0.0.2:8001")
        router = dns_router(dns, servers)
        await router.rediscover()
        before = list(router.servers)
        dns.answers["tts"] = hiccup
        await router.rediscover()
        assert router.servers == before and not any(c.closed for c in servers.clients)
        assert router.pick() in before
        await router.close()

    asyncio.run(scenario())


def test_fixed_servers_stay_and_are_not_doubled_by_dns():
    async def scenario():
        dns, servers = Dns(tts=["10.0.0.1", "10.0.0.2"]), FakeServers("10.0.0.1:8001", "10.0.0.2:8001")
        router = dns_router(dns, servers, fixed=("grpc://10.0.0.1:8001",))
        await router.check_all()
        await router.rediscover()
        assert list(members(router)) == ["10.0.0.1:8001", "10.0.0.2:8001"]
        assert router.servers[0].source is None and router.servers[1].source == SPEC
        dns.answers["tts"] = ["10.0.0.3"]  # neither address is named any more: only the DNS one leaves
        await router.rediscover()
        assert list(members(router)) == ["10.0.0.1:8001", "10.0.0.3:8001"]
        await router.close()

    asyncio.run(scenario())


def test_each_dns_spec_keeps_its_servers_when_only_it_fails():
    async def scenario():
        specs = ("dns://a.test:8001", "dns://b.test:9001?metrics_port=9100")
        dns, servers = Dns(a=["10.0.0.1"], b=["10.0.1.1"]), FakeServers()
        router = dns_router(dns, servers, specs=specs)
        await router.rediscover()
        assert list(members(router)) == ["10.0.0.1:8001", "10.0.1.1:9001"]
        assert router.servers[1].target.metrics_url == "http://10.0.1.1:9100/metrics"
        dns.answers.update(a=OSError("timeout"), b=["10.0.1.2"])
        await router.rediscover()
        assert list(members(router)) == ["10.0.0.1:8001", "10.0.1.2:9001"]
        await router.close()

    asyncio.run(scenario())


def test_metrics_follow_the_pool():
    async def scenario():
        dns, servers = Dns(tts=["10.0.0.1", "10.0.0.2"]), FakeServers("10.0.0.1:8001", "10.0.0.2:8001")
        router = dns_router(dns, servers)
        metrics = GatewayMetrics(router)
        router.on_leave = metrics.forget_server
        await router.rediscover()
        for backend in router.servers:
            metrics.routed.labels(backend.name).inc()
        text = metrics.render().decode()
        assert metric_value(text, "cosyvoice_gateway_server_healthy", server="10.0.0.2:8001") == 1
        assert metric_value(text, "cosyvoice_gateway_routed_total", server="10.0.0.2:8001") == 1
        dns.answers["tts"] = ["10.0.0.1"]
        await router.rediscover()
        text = metrics.render().decode()
        assert metric_value(text, "cosyvoice_gateway_server_healthy", server="10.0.0.1:8001") == 1
        assert "10.0.0.2" not in text
        await router.close()

    asyncio.run(scenario())


# ---- a gateway in front of stand-in servers ------------------------------------------------------------------

class ReadyOnly(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers the gateway's health checks as a ready Triton with cosyvoice2 loaded (nothing else)."""

    def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name == "cosyvoice2")


@pytest.fixture
def standins():
    """Two stand-in servers on 127.0.0.1 and 127.0.0.2, one port: (port, servers)."""
    started = []
    try:
        port = 0
        for ip in ("127.0.0.1", "127.0.0.2"):
            server = grpc.server(ThreadPoolExecutor(max_workers=2))
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(ReadyOnly(), server)
            port = server.add_insecure_port(f"{ip}:{port}")
            server.start()
            started.append(server)
        yield port
    finally:
        for server in started:
            server.stop(grace=None)


def test_a_gateway_follows_dns(standins, tmp_path):
    port = standins
    dns = Dns(tts=[])
    config = GatewayConfig(discovery=(f"dns://tts.test:{port}",), voice_store=str(tmp_path / "voices.sqlite"),
                           home=tmp_path, default_voice=False,
                           routing=RoutingConfig(discovery_interval_s=0.1, health_interval_s=0.5))
    one, two = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
    with GatewayThread(config, resolve=dns) as gateway:
        # Nothing resolved yet: the gateway serves, but is not ready.
        assert gateway.get_json("/healthz")[0] == 200
        assert gateway.get_json("/readyz") == (503, {"status": "starting", "ready": False, "servers": {},
                                                     "waiting_for": ["a tritonserver (none in the pool yet)"],
                                                     "version": __version__, "family": "cosyvoice2",
                                                     "families": [],
                                                     "default_voice": "disabled", "voice_store": "ok",
                                                     "precision": {}, "capacity": {}})  # no server scraped yet

        dns.answers["tts"] = ["127.0.0.1", "127.0.0.2"]
        gateway.wait_ready(timeout_s=30)
        wait_until(lambda: gateway.get_json("/readyz")[1]["servers"] == {one: True, two: True}, WAIT_S)

        dns.answers["tts"] = ["127.0.0.2"]
        wait_until(lambda: gateway.get_json("/readyz")[1]["servers"] == {two: True}, WAIT_S)
        text = scrape(gateway.url + "/metrics")
        assert metric_value(text, "cosyvoice_gateway_server_healthy", server=two) == 1
        assert one not in text
        wait_until(lambda: gateway.call(lambda app: not app[ROUTER].draining), WAIT_S)  # its channel closed

        # DNS fails for several rounds: the pool stays as it was.
        dns.answers["tts"] = OSError("no DNS")
        seen = dns.lookups
        wait_until(lambda: dns.lookups >= seen + 3, WAIT_S)
        status, body = gateway.get_json("/readyz")
        assert status == 200 and body["servers"] == {two: True}
