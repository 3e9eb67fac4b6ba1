"""A real redis-server for tests: a free port on 127.0.0.1, a temporary folder, no persistence.

```
from redis_harness import redis_server  # noqa: F401  (session fixture: import it into the test module)

def test_x(redis_server):
    redis_server.flush()                 # tests share the server: start from an empty database
    store = open_voice_store(redis_server.url)
```
The fixture skips, naming the reason, when `redis-server` is not on PATH (Debian: `apt-get install
redis-server`). The server is killed when the session ends, and with the test process if that dies.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from cosyvoice_triton.server import free_port
from cosyvoice_triton.server.process import _term_with_parent

START_ATTEMPTS = 3  # another process may take the free port before redis-server binds it
READY_TIMEOUT_S = 10.0


@dataclass
class RedisServer:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def flush(self) -> None:
        with self.client() as client:
            client.flushall()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def start_redis(binary: str, workdir: Path) -> RedisServer:
    """Start redis-server in `workdir`; return once it answers PING."""
    for _ in range(START_ATTEMPTS):
        port = free_port()
        log_path = workdir / f"redis-{port}.log"
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                   "--save", "", "--appendonly", "no", "--logfile", str(log_path)]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT, preexec_fn=_term_with_parent)
        server = RedisServer(process, port, log_path)
        if _wait_ready(server):
            return server
        server.stop()
    log = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else "(no log)"
    raise RuntimeError(f"redis-server did not start after {START_ATTEMPTS} attempts; last log:\n{log}")


def _wait_ready(server: RedisServer) -> bool:
    """True once our server answers; False if it exits (port taken) or stays silent."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with redis.Redis(port=server.port, socket_connect_timeout=0.5, socket_timeout=0.5) as client:
        while time.monotonic() < deadline and server.process.poll() is None:
            try:  # the pid check: whoever took the port first must not pass for our server
                return client.info("server")["process_id"] == server.process.pid
            except redis.ConnectionError:
                time.sleep(0.05)  # a fresh redis-server binds within milliseconds
    return False


def redis_binary_or_skip() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not found on PATH (Debian: apt-get install redis-server)")
    return binary


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    server = start_redis(redis_binary_or_skip(), tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()
