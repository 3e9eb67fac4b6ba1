"""A redis-server process of our own: a free port on 127.0.0.1, a given folder.

Used by `cosyvoice-triton up --frontends N --backends M` (the split topology's shared voice store, unless
`--redis-url` names one; persisted there: `persist=True` keeps an append-only file under the folder,
fsynced every second, which a later redis-server in the same folder loads) and by the tests (no
persistence). The server gets SIGTERM when the process (thread) that started it dies; `stop()` is a
SIGTERM too, so the append-only file is flushed; `restart()` starts it again on the same port.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from cosyvoice_triton.errors import CosyVoiceError, RedisNotFound
from cosyvoice_triton.server.process import free_port, term_with_parent


def find_redis_server() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisNotFound("redis-server not found on PATH (Debian: apt-get install redis-server), "
                            "or give --redis-url")
    return binary


START_ATTEMPTS = 3  # another process may take the free port before redis-server binds it
READY_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0  # SIGTERM (the append-only file is written out), then SIGKILL


@dataclass
class RedisServer:
    process: subprocess.Popen
    port: int
    log_path: Path
    binary: str
    workdir: Path
    persist: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def flush(self) -> None:
        with self.client() as client:
            client.flushall()

    def is_running(self) -> bool:
        return self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def restart(self) -> RedisServer:
        """Start again on the same port, after the process exited (what it persisted is loaded)."""
        if self.is_running():
            return self
        self.process = _launch(self.binary, self.workdir, self.port, self.log_path, self.persist)
        if not _wait_ready(self):
            self.stop()
            raise CosyVoiceError(f"redis-server did not start again on port {self.port}; log {self.log_path}:\n"
                                 f"{_log_tail(self.log_path)}")
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()


def start_redis(binary: str, workdir: Path, persist: bool = False) -> RedisServer:
    """Start redis-server in `workdir`; return once it answers PING. `persist`: an append-only file in
    `workdir` (loaded again by the next redis-server started there)."""
    for _ in range(START_ATTEMPTS):
        port = free_port()
        log_path = workdir / f"redis-{port}.log"
        process = _launch(binary, workdir, port, log_path, persist)
        server = RedisServer(process, port, log_path, binary, Path(workdir), persist)
        if _wait_ready(server):
            return server
        server.stop()
    raise CosyVoiceError(f"redis-server did not start after {START_ATTEMPTS} attempts; last log:\n"
                         f"{_log_tail(log_path)}")


def _launch(binary: str, workdir: Path, port: int, log_path: Path, persist: bool) -> subprocess.Popen:
    persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if persist else ["--appendonly", "no"]
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
               "--save", "", *persistence, "--logfile", str(log_path)]
    return subprocess.Popen(term_with_parent(command), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def _log_tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-2000:] if log_path.exists() else "(no log)"


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
