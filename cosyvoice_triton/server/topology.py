"""A split deployment on one machine: N frontend servers, M backend servers and a shared voice store.

```
topology = SplitTopology(ServeOptions(model_dir=...), frontends=2, backends=1, run_dir=Path("run"))
topology.start()        # redis-server (unless options.voice_store is a redis:// url), then every server
topology.frontends      # TritonProcess list: put a gateway in front of these
topology.stop()
```
Backends run `--role backend` (token2wav only); frontends run `--role frontend` with every backend as a
`--backend`, so each stream's token2wav work goes to the backend with the least outstanding work (and, with
`options.official_models`, hold cosyvoice2_official* too: `role_models`). The
servers start on free ports, backends first, each in its own run folder (`<run_dir>/frontend-0`, `backend-0`, ...). Frontends and the gateway share
one voice store, Redis, so a voice registered anywhere is usable everywhere; the redis-server started
here keeps an append-only file in `<run_dir>/redis`, so a topology started again on the same run folder
has the same voices. `describe()` (also written to `<run_dir>/topology.json`) lists every process, its
pid and endpoints; `processes()` names them for a `Supervisor` (each restarts on its own ports).
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from cosyvoice_triton.server.launcher import ServeOptions, prepare
from cosyvoice_triton.server.process import TritonProcess
from cosyvoice_triton.server.redis_process import RedisServer, find_redis_server, start_redis

log = logging.getLogger(__name__)


class SplitTopology:
    def __init__(self, options: ServeOptions, frontends: int, backends: int, run_dir: Path, **process_kwargs):
        if frontends < 1 or backends < 1:
            raise ValueError(f"a split topology needs at least one frontend and one backend, got {frontends} "
                             f"and {backends}")
        self.options = options
        self.counts = (frontends, backends)
        self.run_dir = Path(run_dir)
        self.process_kwargs = process_kwargs  # to TritonProcess (die_with_parent, binary)
        self.redis: RedisServer | None = None
        self.frontends: list[TritonProcess] = []
        self.backends: list[TritonProcess] = []

    @property
    def voice_store(self) -> str:
        return self.redis.url if self.redis is not None else str(self.options.voice_store)

    def start(self) -> SplitTopology:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        frontends, backends = self.counts
        try:
            if not str(self.options.voice_store or "").startswith(("redis://", "rediss://")):
                redis_dir = self.run_dir / "redis"
                redis_dir.mkdir(exist_ok=True)
                self.redis = start_redis(find_redis_server(), redis_dir, persist=True)
            common = replace(self.options, http_port=None, grpc_port=None, metrics_port=None,
                             voice_store=self.voice_store)
            # One after the other, from this thread: a server's "die with its parent" is tied to the thread
            # that started it. Backends first, so the frontends can be told their addresses.
            for i in range(backends):
                self.backends.append(self._start(replace(common, role="backend"), f"backend-{i}"))
            addresses = tuple(b.target.spec for b in self.backends)
            for i in range(frontends):
                self.frontends.append(self._start(replace(common, role="frontend", backends=addresses),
                                                  f"frontend-{i}"))
        except BaseException:
            self.stop()
            raise
        (self.run_dir / "topology.json").write_text(json.dumps(self.describe(), indent=2))
        return self

    def _start(self, options: ServeOptions, name: str) -> TritonProcess:
        server = prepare(replace(options, run_dir=self.run_dir / name), **self.process_kwargs)
        log.info("starting %s (log %s)", name, server.log_path)
        return server.start()

    def processes(self) -> dict[str, TritonProcess | RedisServer]:
        """Every process by name: "backend-0", ..., "frontend-0", ..., "redis" (when started here)."""
        named = {**{f"backend-{i}": p for i, p in enumerate(self.backends)},
                 **{f"frontend-{i}": p for i, p in enumerate(self.frontends)}}
        return {**named, "redis": self.redis} if self.redis is not None else named

    def describe(self) -> dict:
        def server(process: TritonProcess) -> dict:
            return {"pid": process.pid, "grpc": process.grpc_url, "http": process.http_url,
                    "metrics": process.metrics_url, "log": str(process.log_path)}

        return {"frontends": [server(p) for p in self.frontends], "backends": [server(p) for p in self.backends],
                "voice_store": self.voice_store, "redis_pid": self.redis.process.pid if self.redis else None}

    def named_servers(self) -> dict[str, TritonProcess]:
        """Every tritonserver by the name `stop` reports it under (frontend-0, ..., backend-0, ...)."""
        return {**{f"frontend-{i}": s for i, s in enumerate(self.frontends)},
                **{f"backend-{i}": s for i, s in enumerate(self.backends)}}

    def stop(self) -> dict[str, int | None]:
        """Frontends first (their streams end), then backends, then Redis. Returns the exit code of each
        server that was running until now (one that had died already is left out: it was not stopped)."""
        codes = {}
        for name, server in self.named_servers().items():
            running = server.is_running()
            code = server.stop()
            if running:
                codes[name] = code
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        return codes
