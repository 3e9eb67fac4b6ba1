"""A real gateway served from a background thread, for tests and notebooks (any client library can call it).

```
with GatewayThread(config) as gateway:       # binds a free port on 127.0.0.1
    gateway.wait_ready()                     # /readyz answers 200
    requests.post(gateway.url + "/v1/tts", json={...})
    gateway.call(lambda app: app[ROUTER].servers[0].healthy)   # run code on the gateway's loop
```
`GatewayThread(config, resolve=fn)` answers the DNS lookups of `dns://` servers with `fn(host, port)`.
The gateway runs with `handler_cancellation=True`, as `run` serves it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future

from aiohttp import web

from cosyvoice_triton.targets import Resolver, resolve_ips

from .app import create_app
from .config import GatewayConfig


class GatewayThread:
    def __init__(self, config: GatewayConfig, host: str = "127.0.0.1", resolve: Resolver = resolve_ips):
        self.config = dataclasses.replace(config, host=host, port=0)
        self.resolve = resolve
        self.app: web.Application | None = None
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="gateway", daemon=True)
        self._started: Future = Future()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> GatewayThread:
        self._thread.start()
        self._started.result(timeout=timeout_s)  # raises what startup raised
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = None
        try:
            self.app = create_app(self.config, resolve=self.resolve)
            runner = web.AppRunner(self.app, handler_cancellation=True,
                                   shutdown_timeout=self.config.shutdown_timeout_s)
            self._loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.config.host, 0)
            self._loop.run_until_complete(site.start())
            self.port = runner.addresses[0][1]
        except BaseException as exc:
            self._started.set_exception(exc)
            if runner is not None:
                self._loop.run_until_complete(runner.cleanup())
            return
        self._started.set_result(None)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(runner.cleanup())
            self._loop.close()

    def call(self, fn, timeout_s: float = 10.0):
        """`fn(app)` on the gateway's loop (a coroutine function's result is awaited)."""
        async def run():
            result = fn(self.app)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    def get_json(self, path: str, timeout_s: float = 10.0) -> tuple[int, dict]:
        return get_json(self.url + path, timeout_s)

    def wait_ready(self, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            status, body = self.get_json("/readyz")
            if status == 200:
                return body
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway not ready after {timeout_s:.0f} s: {body}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=self.config.shutdown_timeout_s + 30)

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def get_json(url: str, timeout_s: float = 10.0) -> tuple[int, dict]:
    """(status, JSON body) of GET `url`, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
