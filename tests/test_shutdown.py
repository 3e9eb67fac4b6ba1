"""Supervision and draining, piece by piece, on real processes and a real aiohttp server (no tritonserver:
tests/test_faults.py runs them together under `cosyvoice-triton up`).

* `Supervisor`: a process that dies is started again, with backoff while restarts fail; a group stays
  ready while one of its members is down; after `close()` nothing is restarted.
* `RedisServer` with `persist=True`: what it held survives a kill -9 and a fresh server in the same folder.
* `Drain`: once draining, new requests get 503 naming the reason, requests in flight finish, and
  `wait_idle` reports whether they did within the grace period.
"""
from __future__ import annotations

import asyncio
import subprocess
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest

from cosyvoice_triton.gateway.drain import Drain, drain_readiness
from cosyvoice_triton.gateway.errors import error_middleware
from cosyvoice_triton.gateway.up import ProcessCollector, supervision_readiness
from cosyvoice_triton.server.supervisor import Backoff, Supervisor
from polling import wait_until

pytestmark = pytest.mark.timeout(120)

QUICK = Backoff(initial_delay_s=0.05, max_delay_s=0.2)


class SleepProcess:
    """A real child process (`sleep`) with the supervised interface; `failures` restarts fail first."""

    def __init__(self, failures: int = 0):
        self.failures = failures
        self.starts = 0
        self._launch()

    def _launch(self) -> None:
        self.process = subprocess.Popen(["sleep", "600"])
        self.starts += 1

    def is_running(self) -> bool:
        return self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def restart(self) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("port 8001 is in use")
        self._launch()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def processes():
    made: list[SleepProcess] = []

    def make(failures: int = 0) -> SleepProcess:
        made.append(SleepProcess(failures))
        return made[-1]

    yield make
    for process in made:
        process.stop()


def test_a_killed_process_is_started_again_and_counted(processes):
    server = processes()
    supervisor = Supervisor({"tritonserver": server}, QUICK).begin()
    first_pid = server.process.pid
    server.process.kill()
    wait_until(lambda: supervisor.states()["tritonserver"]["restarts"] == 1, timeout_s=30)
    state = supervisor.states()["tritonserver"]
    assert state["state"] == "running" and state["last_exit_code"] == -9
    assert server.is_running() and server.process.pid != first_pid and supervisor.ready()
    supervisor.close(server.stop)
    assert supervisor.states()["tritonserver"]["state"] == "stopped"


def test_failed_restarts_back_off_and_are_reported_until_one_succeeds(processes):
    server = processes(failures=3)
    supervisor = Supervisor({"tritonserver": server}, QUICK).begin()
    server.process.kill()
    wait_until(lambda: "last_error" in supervisor.states()["tritonserver"], timeout_s=30)
    assert not supervisor.ready() and supervisor.waiting_for() == ["tritonserver (restarting)"]
    waits, body = supervision_readiness(supervisor)  # what /readyz says
    assert waits == ["process tritonserver (restarting)"]
    assert body["processes"]["tritonserver"]["last_error"] == "port 8001 is in use"
    wait_until(lambda: supervisor.states()["tritonserver"]["state"] == "running", timeout_s=30)
    assert server.failures == 0 and server.starts == 2  # three failed attempts, then one that started it
    assert "last_error" not in supervisor.states()["tritonserver"] and supervisor.ready()
    supervisor.close(server.stop)


def test_a_group_is_ready_while_one_member_restarts_and_nothing_restarts_after_close(processes):
    first, second = processes(failures=1000), processes()
    supervisor = Supervisor({"frontend-0": first, "frontend-1": second, "redis": processes()}, QUICK).begin()
    first.process.kill()
    wait_until(lambda: supervisor.states()["frontend-0"]["state"] == "restarting", timeout_s=30)
    assert supervisor.ready()  # frontend-1 carries the group
    second.failures = 1000
    second.process.kill()
    wait_until(lambda: not supervisor.ready(), timeout_s=30)
    assert supervisor.waiting_for() == ["frontend-0 (restarting)", "frontend-1 (restarting)"]

    registry = CollectorRegistry()
    registry.register(ProcessCollector(supervisor, Drain()))
    text = generate_latest(registry).decode()
    assert 'cosyvoice_gateway_process_up{process="frontend-0"} 0.0' in text
    assert 'cosyvoice_gateway_process_up{process="redis"} 1.0' in text
    assert 'cosyvoice_gateway_process_restarts_total{process="frontend-1"} 0.0' in text

    supervisor.close()
    first.failures = second.failures = 0
    starts = first.starts, second.starts
    assert [s["state"] for s in supervisor.states().values()] == ["stopped"] * 3
    assert (first.starts, second.starts) == starts and not first.is_running()


def test_a_persisted_redis_keeps_its_data_through_kill_and_a_new_server(tmp_path):
    from redis_harness import redis_binary_or_skip
    from cosyvoice_triton.server.redis_process import start_redis

    binary = redis_binary_or_skip()
    server = start_redis(binary, tmp_path, persist=True)
    try:
        with server.client() as client:
            client.set("voice", b"kept")
        port = server.port
        server.process.kill()  # kill -9: what was written is in the append-only file already
        server.process.wait()
        assert not server.is_running() and server.exit_code == -9
        server.restart()
        assert server.port == port
        with server.client() as client:
            assert client.get("voice") == b"kept"
    finally:
        server.stop()
    assert server.exit_code == 0  # SIGTERM: a clean stop
    again = start_redis(binary, tmp_path, persist=True)  # `up` started again on the same run folder
    try:
        with again.client() as client:
            assert client.get("voice") == b"kept"
    finally:
        again.stop()


def test_a_draining_app_refuses_new_requests_and_lets_those_in_flight_finish():
    asyncio.run(_drain_scenario())


async def _drain_scenario() -> None:
    drain = Drain()
    release = asyncio.Event()
    router = SimpleNamespace(servers=[SimpleNamespace(inflight=0)])  # the router's in-flight Triton calls

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"done": True})

    async def readyz(request: web.Request) -> web.Response:
        waits, body = drain_readiness(drain)
        return web.json_response(body, status=503 if waits else 200)

    app = web.Application(middlewares=[error_middleware, drain.middleware])
    app.router.add_get("/slow", slow)
    app.router.add_get("/readyz", readyz)
    async with TestClient(TestServer(app)) as client:
        in_flight = asyncio.create_task(client.get("/slow"))
        while drain.in_flight == 0:
            await asyncio.sleep(0.01)
        drain.begin("the server is shutting down")

        refused = await client.get("/slow")
        body = await refused.json()
        assert refused.status == 503 and refused.headers["Retry-After"] == "1"
        assert "the server is shutting down" in body["error"]["message"], body
        ready = await client.get("/readyz")  # still answered, and says why not ready
        assert ready.status == 503 and (await ready.json())["status"] == "draining"

        assert not await drain.wait_idle(router, grace_s=0.2)  # the slow request holds it
        router.servers[0].inflight = 1
        release.set()
        response = await in_flight
        assert response.status == 200 and (await response.json()) == {"done": True}
        assert drain.in_flight == 0 and drain.busy(router) == 1  # a WebSocket's Triton call is still open
        router.servers[0].inflight = 0
        assert await drain.wait_idle(router, grace_s=5)
