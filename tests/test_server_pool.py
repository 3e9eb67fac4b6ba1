"""The server pool's bookkeeping on its own (no I/O): least outstanding work, ties to the server picked
least recently, health, DNS join/leave with draining. The gateway's router (tests/test_gateway_routing.py,
tests/test_gateway_discovery.py) and the split frontend's token2wav client (tests/test_split_units.py)
drive it with real timing and transports."""
from __future__ import annotations

from cosyvoice_triton.server_pool import Server, ServerPool
from cosyvoice_triton.targets import TritonTarget

SPEC = "dns://tts.test:8001"


def target(host: str) -> TritonTarget:
    return TritonTarget(f"{host}:8001", f"http://{host}:8002/metrics")


def fixed_pool(n: int) -> ServerPool:
    return ServerPool([Server(target(f"h{i}"), client=f"client-{i}", healthy=True) for i in range(n)])


def test_least_outstanding_work_wins():
    pool = fixed_pool(3)
    a, b, c = pool.servers
    pool.acquire(a, 5.0)
    pool.acquire(b, 2.0)
    assert pool.pick() is c
    pool.acquire(c, 9.0)
    assert pool.pick() is b
    assert pool.release(a, 5.0) is False  # a member: nothing to close
    assert (a.outstanding_cost, a.inflight) == (0.0, 0) and pool.pick() is a


def test_others_work_counts_at_the_mean_request_cost():
    pool = fixed_pool(2)
    a, b = pool.servers
    pool.acquire(a, 1.0)
    pool.set_external(b, 3.0)  # the server runs 3 requests, none of them ours
    assert b.external == 3.0 and pool.load(b) == 3.0 * pool.mean_cost
    assert pool.pick() is a
    pool.set_external(a, 1.0)  # the one it runs is ours
    assert a.external == 0.0


def test_ties_go_to_the_server_picked_least_recently():
    pool = fixed_pool(3)
    assert [pool.pick().name for _ in range(6)] == ["h0:8001", "h1:8001", "h2:8001"] * 2
    assert pool.pick(exclude=[pool.servers[0]]).name == "h1:8001"


def test_an_unhealthy_server_leaves_rotation_and_rejoins_without_its_stale_load():
    pool = fixed_pool(2)
    a, b = pool.servers
    b.external, b.pending = 4.0, 2.0
    assert pool.set_health(b, False) is True and pool.set_health(b, False) is False
    assert [pool.pick() for _ in range(3)] == [a, a, a] and pool.healthy() == [a]
    assert pool.set_health(b, True) is True
    assert (b.external, b.pending) == (0.0, 0.0) and pool.pick() is b
    pool.set_health(a, False)
    pool.set_health(b, False)
    assert pool.pick() is None


def test_discovered_servers_join_and_leave_with_draining():
    pool = ServerPool([Server(target("fixed"), "c", healthy=True)], joins_healthy=False)
    made = []
    new_client = lambda t: made.append(t.name) or f"client-{t.name}"  # noqa: E731
    update = pool.update(SPEC, [target("10.0.0.1"), target("10.0.0.2"), target("fixed")], new_client)
    one, two = update.joined
    assert made == ["10.0.0.1:8001", "10.0.0.2:8001"]  # the fixed server is not doubled
    assert (one.source, one.healthy, one.client) == (SPEC, False, "client-10.0.0.1:8001")
    assert pool.pick() is pool.servers[0]  # joined, but not healthy until checked
    pool.set_health(one, True)
    pool.set_health(two, True)
    pool.acquire(two)

    update = pool.update(SPEC, [target("10.0.0.1")], new_client)  # 10.0.0.2 is gone, a request runs there
    assert update.left == [two] and update.idle == [] and pool.draining == [two]
    assert two not in pool.servers and two.leaving and not two.healthy
    assert pool.set_health(two, True) is False  # a server that left stays out
    assert all(pool.pick() is not two for _ in range(4))
    assert pool.everyone() == [*pool.servers, two]
    assert pool.release(two) is True and pool.draining == []  # its last request ended: close it

    update = pool.update(SPEC, [target("10.0.0.3")], new_client)  # an idle server leaves: close it now
    assert update.left == [one] and update.idle == [one] and pool.draining == []
    assert [s.name for s in pool.servers] == ["fixed:8001", "10.0.0.3:8001"]


def test_an_empty_answer_keeps_the_specs_servers_and_fixed_servers_never_leave():
    pool = ServerPool([Server(target("fixed"), "c", healthy=True)], joins_healthy=True)
    pool.update(SPEC, [target("10.0.0.1")], lambda t: None)
    before = list(pool.servers)
    update = pool.update(SPEC, [], lambda t: None)
    assert (update.joined, update.left) == ([], []) and pool.servers == before
    assert pool.servers[1].healthy  # this pool lets servers take work before their first check
    pool.update(SPEC, [target("10.0.0.2")], lambda t: None)
    assert [s.name for s in pool.servers] == ["fixed:8001", "10.0.0.2:8001"]
