"""Routing over several Triton servers, retries, health, and voices shared through Redis.

Unit tests of the router and the cost model first (no servers). Then two real tritonservers (tiny model,
both on one real redis-server as voice store) and gateways in this process: R routes over both, A uses
only the first, B only the second, D a dead address and the first. The last test kills the second
server mid-run. After it, a gateway that finds both servers through a scripted DNS sees the second leave.
"""
from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
import time

import aiohttp
import pytest
import soundfile as sf

from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.gateway.config import GatewayConfig, RoutingConfig
from cosyvoice_triton.targets import TritonTarget
from cosyvoice_triton.errors import Unavailable
from cosyvoice_triton.admission import BASE_COST, ENCODE_COST
from cosyvoice_triton.gateway.routing import CostModel, Router
from cosyvoice_triton.prometheus_text import metric_sum
from cosyvoice_triton.gateway.state import ROUTER
from cosyvoice_triton.server_pool import Server
from cosyvoice_triton.gateway.testing import GatewayThread, get_json
from cosyvoice_triton.errors import CosyVoiceError, InvalidInput, NotFound, RemoteError, Unavailable, from_wire
from cosyvoice_triton.server import free_port
from cli_harness import CliProcess
from polling import wait_until
from redis_harness import redis_server  # noqa: F401  (a fixture)
from triton_harness import metric_value, scrape, tritonserver_or_skip

pytestmark = pytest.mark.timeout(420)

RATIO = 3.0
SHORT = "A short request."
# Many sentences: the random LLM may draw a stop token early in any one of them, but the stream runs on
# through all 25 (one long sentence could end after a few tokens and leave nothing running).
LONG = " ".join(["This sentence keeps the stream going on and on."] * 25)
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=90)  # no client may wait longer than this
WAIT_S = 60.0  # for a gateway or server to reach a state


# ---- the router without servers ------------------------------------------------------------------------

def test_triton_targets():
    assert TritonTarget.parse("grpc://10.0.0.5:8001") == TritonTarget("10.0.0.5:8001", "http://10.0.0.5:8002/metrics")
    assert TritonTarget.parse("gpu-3:9001").metrics_url == "http://gpu-3:9002/metrics"
    given = TritonTarget.parse("grpc://a:8001?metrics=http://b:9100/metrics")
    assert given == TritonTarget("a:8001", "http://b:9100/metrics")
    for bad in ("http://a:8001", "grpc://a", "grpc://:8001"):
        with pytest.raises(ValueError):
            TritonTarget.parse(bad)


def test_cost_grows_with_text_and_prompt(tiny_model_dir):
    costs = CostModel.from_model_dir(tiny_model_dir)
    assert costs.tokenizer is not None
    short, long = costs.estimate(SHORT, 50, False), costs.estimate(LONG, 50, False)
    assert BASE_COST < short < long
    assert costs.estimate(SHORT, 100, False) > short
    assert costs.estimate(SHORT, 50, True) == pytest.approx(short + ENCODE_COST)
    assert CostModel().text_tokens("x" * 40) == 10  # without a tokenizer: bytes / 4


def router(n: int = 2) -> Router:
    backends = [Server(TritonTarget(f"h{i}:8001", f"http://h{i}:8002/metrics"), client=None, healthy=True)
                for i in range(n)]
    return Router(backends, RoutingConfig(), "cosyvoice2")


def test_least_outstanding_cost_wins_and_ties_alternate():
    r = router(2)
    a, b = r.servers
    assert [r.pick().name for _ in range(4)] == ["h0:8001", "h1:8001", "h0:8001", "h1:8001"]
    with r.lease(a, 1000.0):
        assert a.outstanding_cost == 1000.0 and a.inflight == 1
        picks = []
        for _ in range(3):  # three cheap requests all go to the idle server while the costly one runs
            backend = r.pick()
            picks.append(backend.name)
        assert picks == ["h1:8001"] * 3
        with r.lease(b, 600.0), r.lease(b, 600.0):
            assert r.pick() is a
    assert a.outstanding_cost == 0 and a.inflight == 0
    b.external = 3  # three requests there that other gateways sent
    assert r.pick() is a and r.load(b) == pytest.approx(3 * r.mean_cost)


def test_unhealthy_and_excluded_servers_are_skipped():
    r = router(3)
    a, b, c = r.servers
    r.set_health(b, False, "test")
    assert {r.pick(exclude=[a]).name for _ in range(3)} == {"h2:8001"}
    r.set_health(c, False, "test")
    with pytest.raises(Unavailable):
        r.pick(exclude=[a])
    r.set_health(b, True)
    assert r.pick(exclude=[a]) is b


def test_a_server_that_leaves_the_pool_forgets_its_scraped_load():
    r = router(2)
    a, b = r.servers
    b.external, b.pending = 2, 1  # scraped while streams ran there
    r.set_health(b, False, "killed")
    r.set_health(b, True)  # restarted: those streams died with it
    a.external = 1
    assert (b.external, b.pending) == (0, 0) and r.pick() is b


def test_metric_parsing_and_error_messages():
    text = ('nv_inference_pending_request_count{model="cosyvoice2",version="1"} 3\n'
            'nv_inference_pending_request_count{model="cosyvoice2_offline",version="1"} 7\n'
            'cosyvoice_active_streams{instance="cosyvoice2_0_0",model="cosyvoice2"} 2\n'
            'cosyvoice_active_streams{instance="cosyvoice2_1_0",model="cosyvoice2"} 1\n')
    assert metric_sum(text, "nv_inference_pending_request_count", "cosyvoice2") == 3
    assert metric_sum(text, "cosyvoice_active_streams", "cosyvoice2") == 3
    def read(error) -> RemoteError:  # as a model's error comes back to the gateway
        return RemoteError(from_wire(error.to_wire()))

    invalid = read(InvalidInput("target_text", "must not be empty"))
    assert (invalid.code, invalid.field, invalid.problem, invalid.retryable) == (
        "invalid_input", "target_text", "must not be empty", False)
    assert read(NotFound("reference_audio_id", "no voice 'x' is registered")).code == "not_found"
    busy = read(Unavailable("cosyvoice2 has 16 requests running and 64 waiting"))
    assert busy.code == "unavailable" and busy.retryable
    assert not read(CosyVoiceError("internal error (KeyError)")).retryable
    unknown_model = RemoteError(from_wire("Request for unknown model 'x'", "NOT_FOUND"))
    assert (unknown_model.code, unknown_model.field, unknown_model.retryable) == ("not_found", None, False)
    unreachable = RemoteError(from_wire("failed to connect to all addresses", "UNAVAILABLE"))
    assert unreachable.code == "unreachable" and unreachable.retryable


# ---- two real servers --------------------------------------------------------------------------------

def start_server(model_dir, run_dir, voice_store: str):
    """A server on fixed free ports (a restart keeps them, so gateways find it again)."""
    from cosyvoice_triton.server.launcher import ServeOptions, prepare

    options = ServeOptions(model_dir=model_dir, run_dir=run_dir, address="127.0.0.1", http_port=free_port(),
                           grpc_port=free_port(), metrics_port=free_port(), voice_store=voice_store,
                           max_token_text_ratio=RATIO, torch_threads=1, workers=4)
    server = prepare(options, binary=tritonserver_or_skip(), die_with_parent=True)
    server.start()
    return server


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory, redis_server):  # noqa: F811
    redis_server.flush()
    started = []
    try:
        for name in ("t1", "t2"):
            started.append(start_server(tiny_model_dir, tmp_path_factory.mktemp(name), redis_server.url))
        yield started
    finally:
        for server in started:
            server.stop()


def target(server) -> TritonTarget:
    return server.target


@pytest.fixture(scope="module")
def gateways(servers, tiny_model_dir, tmp_path_factory, redis_server):  # noqa: F811
    t1, t2 = servers
    home = tmp_path_factory.mktemp("home")
    fast = RoutingConfig(health_interval_s=1.0, metrics_interval_s=1.0, first_chunk_timeout_s=30.0,
                         chunk_timeout_s=30.0)
    slow_health = RoutingConfig(health_interval_s=600.0, metrics_interval_s=1.0)
    dead = TritonTarget(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}/metrics")
    configs = {"R": ((target(t1), target(t2)), fast), "A": ((target(t1),), fast), "B": ((target(t2),), fast),
               "D": ((dead, target(t1)), slow_health)}
    running = {}
    try:
        for name, (targets, routing) in configs.items():
            config = GatewayConfig(triton=targets, voice_store=redis_server.url, model_dir=tiny_model_dir, home=home,
                                   routing=routing)
            running[name] = GatewayThread(config).start()
        for gateway in running.values():
            gateway.wait_ready()
        yield running
    finally:
        for gateway in running.values():
            gateway.stop()


def run(coro):
    return asyncio.run(coro)


async def tts(url: str, text: str = SHORT, **extra) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        async with session.post(url + "/v1/tts", json={"text": text, **extra}) as response:
            return response.status, await response.read()


async def stream_bytes(session, url: str, text: str, seed: int, first_audio: asyncio.Event) -> int:
    """Stream `text` from the gateway at `url` to its end; `first_audio` is set at the first bytes."""
    body = {"text": text, "seed": seed, "stream": True, "format": "pcm_s16le"}
    async with session.post(url + "/v1/tts", json=body) as response:
        assert response.status == 200
        total = len(await response.content.readany())
        first_audio.set()
        async for data in response.content.iter_any():
            total += len(data)
        return total


def routed(gateway: GatewayThread) -> dict[str, float]:
    text = scrape(gateway.url + "/metrics")
    return {b.name: metric_value(text, "cosyvoice_gateway_routed_total", server=b.name) or 0.0
            for b in gateway.call(lambda app: list(app[ROUTER].servers))}


def ok_count(server) -> float:
    """Synthesis requests a server finished well: streamed (cosyvoice2) and whole (cosyvoice2_offline)."""
    text = scrape(server.metrics_url)
    return sum(metric_value(text, "cosyvoice_requests_total", model=model, outcome="ok") or 0.0
               for model in ("cosyvoice2", "cosyvoice2_offline"))


@pytest.fixture
def gateway_process(servers, redis_server, tmp_path):  # noqa: F811
    """A gateway as users start it, `python -m cosyvoice_triton.gateway --redis-url ...`, in front of t2 only."""
    port = free_port()
    t2 = servers[1].target
    command = [sys.executable, "-m", "cosyvoice_triton.gateway", "--redis-url", redis_server.url,
               "--triton", f"grpc://{t2.grpc}?metrics={t2.metrics_url}", "--host", "127.0.0.1", "--port", str(port)]
    process = CliProcess(command, {**os.environ, "COSYVOICE_HOME": str(tmp_path)})
    gateway = GatewayProcess(process, f"http://127.0.0.1:{port}")
    try:
        gateway.wait_ready()
        yield gateway
    finally:
        process.kill()
    assert not (tmp_path / "voices.sqlite").exists(), "--redis-url must keep voices in Redis, not in SQLite"


class GatewayProcess:
    def __init__(self, process: CliProcess, url: str):
        self.process, self.url = process, url

    def get_json(self, path: str) -> tuple[int, dict]:
        try:
            return get_json(self.url + path)
        except OSError:  # not listening yet
            return 0, {}

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.get_json("/readyz")[0] != 200:
            assert self.process.running() and time.monotonic() < deadline, self.process.output()
            time.sleep(0.2)


def test_a_voice_registered_through_one_gateway_serves_on_another(gateways, gateway_process):
    a, b = gateways["A"], gateway_process
    audio = io.BytesIO()
    sf.write(audio, speech_like(2.0, 16000, seed=5), 16000, format="WAV", subtype="PCM_16")

    async def register() -> tuple[int, dict]:
        form = aiohttp.FormData()
        form.add_field("audio", audio.getvalue(), filename="p.wav", content_type="audio/wav")
        form.add_field("text", "a shared voice prompt")
        form.add_field("id", "shared")
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            async with session.post(a.url + "/v1/voices", data=form) as response:
                return response.status, await response.json()

    status, voice = run(register())  # through A's only server, t1, into Redis
    assert status == 201 and voice["id"] == "shared", voice
    status, listed = b.get_json("/v1/voices")
    assert status == 200 and {"shared", "default"} <= {v["id"] for v in listed["voices"]}
    status, body = run(tts(b.url, "Spoken on the other server.", voice_id="shared", seed=2))  # t2 reads it from Redis
    assert status == 200, body[:300]
    samples, rate = sf.read(io.BytesIO(body))
    assert rate == 24000 and samples.size > 0
    status, _ = run(tts(a.url, "And on the first one.", voice_id="shared", seed=2))
    assert status == 200

    async def delete():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            async with session.delete(b.url + "/v1/voices/shared") as response:
                return response.status

    assert run(delete()) == 200
    assert a.get_json("/v1/voices/shared")[0] == 404


def test_streams_another_gateway_runs_steer_requests_away(gateways, servers):
    """R's own accounting is empty; what it knows of t1's load comes only from scraping t1's metrics while
    gateway A (which routes to t1 alone) streams there: R's next pick is t2."""
    r, a = gateways["R"], gateways["A"]
    t1, t2 = servers

    def scraped_view() -> tuple[float, float, set[str]]:
        def view(app):  # on R's loop: no scrape between reading the load and picking
            router = app[ROUTER]
            by_name = {b.name: b for b in router.servers}
            picks = {router.pick().name for _ in range(3)}  # equal loads would alternate between the two
            return by_name[t1.grpc_url].external, by_name[t2.grpc_url].external, picks
        return r.call(view)

    async def scenario():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(stream_bytes(session, a.url, LONG, 500 + i, started[i])) for i in (0, 1)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            views = []
            for _ in range(100):  # the next scrapes (every second) see A's streams on t1
                views.append(await asyncio.to_thread(scraped_view))
                if views[-1][0] > 0 or all(s.done() for s in streams):
                    break
                await asyncio.sleep(0.1)
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return views

    external_t1, external_t2, picks = run(scenario())[-1]
    assert external_t1 > 0 and external_t2 == 0, "R never scraped A's streams on t1"
    assert picks == {t2.grpc_url}
    # The cancelled streams end on t1 and R's next scrapes see it idle again (the next tests count on it).
    wait_until(lambda: r.call(lambda app: [b.external for b in app[ROUTER].servers]) == [0, 0], WAIT_S)


def test_requests_spread_over_both_servers_by_cost(gateways, servers):
    r = gateways["R"]
    t1, t2 = servers
    names = [t1.grpc_url, t2.grpc_url]

    # Equal requests at once: the accounting sends them to both servers.
    before, served_before = routed(r), [ok_count(s) for s in servers]
    statuses = run(_gather(*(tts(r.url, SHORT, seed=i) for i in range(4))))
    assert [s for s, _ in statuses] == [200] * 4
    after = routed(r)
    deltas = [after[n] - before[n] for n in names]
    assert sum(deltas) == 4 and min(deltas) >= 1, deltas
    for server, was, delta in zip(servers, served_before, deltas, strict=True):
        wait_until(lambda server=server, want=was + delta: ok_count(server) == want, WAIT_S)

    # One costly request runs on one server: three cheap ones that come while it runs all go to the other.
    async def costly_then_cheap():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            body = {"text": LONG, "seed": 404, "stream": True, "format": "pcm_s16le"}
            async with session.post(r.url + "/v1/tts", json=body) as response:
                assert response.status == 200 and await response.content.readany()
                during = routed(r)
                results = await _gather(*(tts(r.url, SHORT, seed=10 + i) for i in range(3)))
                return during, results  # leaving the block drops the costly stream

    start = routed(r)
    during, results = run(costly_then_cheap())
    assert [s for s, _ in results] == [200] * 3
    end = routed(r)
    costly = next(n for n in names if during[n] - start[n] == 1)
    cheap = next(n for n in names if n != costly)
    assert end[costly] - during[costly] == 0 and end[cheap] - during[cheap] == 3


def test_a_request_failing_before_its_first_byte_is_retried_on_another_server(gateways):
    d = gateways["D"]
    dead = d.call(lambda app: app[ROUTER].servers[0])
    # The dead address is believed healthy (as a server of the family that just died, before any health check):
    d.call(lambda app: setattr(app[ROUTER].servers[0], "family", "cosyvoice2"))
    d.call(lambda app: setattr(app[ROUTER].servers[0], "healthy", True))
    status, body = run(tts(d.url, SHORT, seed=3))
    assert status == 200 and body[:4] == b"RIFF"
    text = scrape(d.url + "/metrics")
    assert metric_value(text, "cosyvoice_gateway_retries_total") == 1
    assert metric_value(text, "cosyvoice_gateway_errors_total", kind="triton_unreachable") >= 1
    assert metric_value(text, "cosyvoice_gateway_server_healthy", server=dead.name) == 0
    before = routed(d)
    assert run(tts(d.url, SHORT, seed=4))[0] == 200
    assert routed(d)[dead.name] == before[dead.name]  # out of the pool now


def test_killing_a_server_mid_run_and_bringing_it_back(gateways, servers):
    r, b = gateways["R"], gateways["B"]
    t1, t2 = servers

    async def stream_until_the_end(session, seed: int, first_audio: asyncio.Event) -> int:
        return await stream_bytes(session, r.url, LONG, seed, first_audio)

    async def scenario():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(stream_until_the_end(session, 404 + 2 * i, started[i])) for i in (0, 1)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            inflight = {b_.name: b_.inflight for b_ in r.call(lambda app: list(app[ROUTER].servers))}
            assert inflight == {t1.grpc_url: 1, t2.grpc_url: 1}  # one stream on each server
            os.killpg(t2.pid, signal.SIGKILL)
            done, pending = await asyncio.wait(streams, return_when=asyncio.FIRST_EXCEPTION, timeout=80)
            failed = [t for t in done if t.exception() is not None]
            assert len(failed) == 1, "the stream on the killed server must end with an error, not hang"
            assert isinstance(failed[0].exception(), aiohttp.ClientError)
            for task in pending:  # the stream on the live server is fine; leave it
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            # New requests go to the live server.
            return [await tts(r.url, SHORT, seed=20 + i) for i in range(3)]

    results = run(scenario())
    assert [s for s, _ in results] == [200] * 3
    status, ready = r.get_json("/readyz")
    assert status == 200 and ready["servers"] == {t1.grpc_url: True, t2.grpc_url: False}
    assert metric_value(scrape(r.url + "/metrics"), "cosyvoice_gateway_server_healthy", server=t2.grpc_url) == 0
    # A gateway whose only server died answers at once: not ready, 503 for synthesis.
    wait_until(lambda: b.get_json("/readyz")[0] == 503, WAIT_S)
    status, body = run(tts(b.url, SHORT))
    assert status == 503 and b'"unavailable"' in body

    # Back on the same ports: health checks return it to the pool, and it takes requests again.
    t2.stop()
    t2.start()
    wait_until(lambda: r.get_json("/readyz")[1]["servers"][t2.grpc_url], WAIT_S)
    wait_until(lambda: b.get_json("/readyz")[0] == 200, WAIT_S)
    before = routed(r)
    statuses = run(_gather(*(tts(r.url, SHORT, seed=30 + i) for i in range(2))))
    assert [s for s, _ in statuses] == [200, 200]
    assert routed(r)[t2.grpc_url] > before[t2.grpc_url]
    assert run(tts(b.url, SHORT))[0] == 200


async def _gather(*coros):
    return await asyncio.gather(*coros)



# ---- DNS discovery over the two real servers --------------------------------------------------------------

def dns_spec(name: str, server) -> str:
    """`server` as the only address of DNS name `name` (the servers share one address, so each its own name)."""
    from urllib.parse import urlsplit

    grpc_port = server.grpc_url.rsplit(":", 1)[1]
    return f"dns://{name}.test:{grpc_port}?metrics_port={urlsplit(server.metrics_url).port}"


def test_a_server_gone_from_dns_finishes_its_streams_and_leaves(servers, tiny_model_dir, tmp_path_factory,
                                                                 redis_server):  # noqa: F811
    """t2's name comes to resolve to a replacement pod that is not up: t2 leaves the pool while a stream
    runs there, that stream still ends normally, and new requests go to t1 only."""
    t1, t2 = servers
    addresses = {"t1": ["127.0.0.1"], "t2": ["127.0.0.1"]}

    def resolve(host: str, port: int) -> list[str]:
        return list(addresses[host.split(".")[0]])

    # Re-resolution on demand (gateway.call) rather than on a timer: test_gateway_discovery runs the loop.
    routing = RoutingConfig(health_interval_s=1.0, metrics_interval_s=1.0, discovery_interval_s=3600.0)
    config = GatewayConfig(discovery=(dns_spec("t1", t1), dns_spec("t2", t2)), voice_store=redis_server.url,
                           model_dir=tiny_model_dir, home=tmp_path_factory.mktemp("home"), routing=routing)
    replacement = f"127.0.0.3:{t2.grpc_url.rsplit(':', 1)[1]}"
    # Long enough to be streaming on both servers when t2 leaves; short enough to run to its end.
    medium = ", ".join(["this clause keeps the one sentence going on and on"] * 6) + "."

    async def stream(session, url: str, seed: int, first_audio: asyncio.Event) -> int:
        return await stream_bytes(session, url, medium, seed, first_audio)

    with GatewayThread(config, resolve=resolve) as g:
        g.wait_ready()
        wait_until(lambda: g.get_json("/readyz")[1]["servers"] == {t1.grpc_url: True, t2.grpc_url: True}, WAIT_S)
        assert g.call(lambda app: [b.target.metrics_url for b in app[ROUTER].servers]) == [t1.metrics_url,
                                                                                            t2.metrics_url]

        async def scenario():
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
                started = [asyncio.Event(), asyncio.Event()]
                streams = [asyncio.create_task(stream(session, g.url, 500 + i, started[i])) for i in (0, 1)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                inflight = {b.name: b.inflight for b in g.call(lambda app: list(app[ROUTER].servers))}
                assert inflight == {t1.grpc_url: 1, t2.grpc_url: 1}  # one stream on each server
                addresses["t2"] = ["127.0.0.3"]
                await asyncio.to_thread(g.call, lambda app: app[ROUTER].rediscover())
                status, ready = g.get_json("/readyz")
                assert status == 200 and ready["servers"] == {t1.grpc_url: True, replacement: False}
                return await asyncio.gather(*streams)  # neither stream is cut

        totals = run(scenario())
        assert min(totals) > 0
        wait_until(lambda: not g.call(lambda app: app[ROUTER].draining), WAIT_S)  # t2's channel is closed
        before = routed(g)
        statuses = run(_gather(*(tts(g.url, SHORT, seed=40 + i) for i in range(3))))
        assert [s for s, _ in statuses] == [200] * 3
        assert routed(g) == {t1.grpc_url: before[t1.grpc_url] + 3, replacement: 0.0}
        assert f'server="{t2.grpc_url}"' not in scrape(g.url + "/metrics")
