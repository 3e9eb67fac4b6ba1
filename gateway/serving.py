"""Serving the gateway until it is stopped: SIGINT / SIGTERM begins the drain (drain.py), then aiohttp's shutdown.

```
exit_code = await serve_until_stopped(app, host, port, drain_timeout_s=20, out=sys.stdout)
```
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import TextIO

from aiohttp import web

from .drain import CUT_AFTER_DRAIN_S
from .state import DRAIN, ROUTER

WATCH_S = 1.0  # how often `servers_gone` is asked


async def serve_until_stopped(app: web.Application, host: str, port: int, drain_timeout_s: float, out: TextIO,
                              servers_gone: Callable[[], bool] | None = None) -> int:
    """Serve `app` on host:port until SIGINT / SIGTERM, then drain it (`Drain`, up to `drain_timeout_s`)
    and stop it: 0; 1 if `servers_gone()` (asked every WATCH_S) ended it instead."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=CUT_AFTER_DRAIN_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        gone = False
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_S)
            if servers_gone is not None and servers_gone():
                gone = True
                break
        drain, router = app[DRAIN], app[ROUTER]
        drain.begin("the server is shutting down")
        print(f"draining: {drain.busy(router)} request(s) in flight, up to {drain_timeout_s:g} s ...", file=out,
              flush=True)
        finished = await drain.wait_idle(router, drain_timeout_s)
        left = drain.busy(router)
        print("drained" if finished else f"drain timeout: {left} request(s) cut", file=out, flush=True)
        return 1 if gone else 0
    finally:
        await runner.cleanup()  # WebSockets get GOING_AWAY; what is still running is cancelled
