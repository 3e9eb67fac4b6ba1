"""A redis-server process of our own: a free port on 127.0.0.1, a given folder, no persistence.

Used by `cosyvoice-triton up --frontends N --backends M` (the split topology's shared voice store, unless
`--redis-url` names one) and by the tests. The server gets SIGTERM when the process that started it dies.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.server.process import _term_with_parent, free_port


class RedisNotFound(CosyVoiceError, RuntimeError):
    """No redis-server executable."""


def find_redis_server() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisNotFound("redis-server not found on PATH (Debian: apt-get install redis-server), "
                            "or give --redis-url")
    return binary


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
    raise CosyVoiceError(f"redis-server did not start after {START_ATTEMPTS} attempts; last log:\n{log}")


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
