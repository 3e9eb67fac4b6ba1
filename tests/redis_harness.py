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
from collections.abc import Iterator

import pytest

from cosyvoice_triton.server.redis_process import RedisServer, start_redis

__all__ = ["RedisServer", "redis_binary_or_skip", "redis_server", "start_redis"]


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
