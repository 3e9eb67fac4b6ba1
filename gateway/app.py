"""The gateway application: `create_app(config)` builds it, `run(config)` serves it.

Its resources (voice store, one gRPC channel per server, the router's loops, the default voice) live in
`cleanup_ctx`. It never decides synthesis itself: routes hand typed requests to the servers. The routes
are in docs/api/http.md, draining and shutdown in docs/operations/faults.md.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import weakref
from contextlib import suppress
from typing import TextIO

from aiohttp import web

from cosyvoice_triton import __version__
from cosyvoice_triton.random_folder.marker import NOTE as RANDOM_NOTE, is_random
from cosyvoice_triton.server_pool import Server
from cosyvoice_triton.targets import Resolver, resolve_ips

from . import (access_log, admission, routes_kserve, routes_official, routes_openai, routes_tts, routes_vc, routes_voices,
               routes_ws)
from .auth import ApiKeys, RateLimiter, StreamLimiter, auth_middleware
from .config import GatewayConfig
from .default_voice import TRANSCRIPT as DEFAULT_TRANSCRIPT, DefaultVoice
from .drain import CUT_AFTER_DRAIN_S, DRAIN_TIMEOUT_S, Drain, drain_readiness
from .errors import error_middleware
from .metrics import GatewayMetrics
from .request_keys import ERROR_CODE, handle_and_report
from .routing import CostModel, Router, capacity_view
from .serving import serve_until_stopped
from .state import (
    CONFIG,
    COSTS,
    DEFAULT_VOICE,
    DRAIN,
    LIMITER,
    READINESS_CHECKS,
    REGISTRATION_RATE,
    METRICS,
    RESOLVE,
    ROUTER,
    STORE,
    WEBSOCKETS,
)
from .triton_channel import TritonClient

log = logging.getLogger(__name__)

FORM_OVERHEAD_BYTES = 64 * 1024  # multipart boundaries and the small fields next to the audio


def body_limit(max_upload_bytes: int) -> int:
    """Largest request body: an upload as base64 in JSON (4/3 larger) plus the other fields. Audio
    itself is held to `max_upload_bytes` where it is decoded (413 beyond)."""
    return max_upload_bytes * 4 // 3 + FORM_OVERHEAD_BYTES


def create_app(config: GatewayConfig, *, resolve: Resolver = resolve_ips) -> web.Application:
    limits = config.limits
    keys = ApiKeys(keys=config.api_keys, admin=config.admin_keys)
    requests_rate = RateLimiter(limits.requests_per_second, 1.0, limits.request_burst, "requests")
    drain = Drain()  # refuses new requests once begun (gateway/drain.py)
    # outermost: records the status the error middleware chose
    middlewares = [report_middleware(config.access_log), error_middleware, auth_middleware(keys, requests_rate),
                   drain.middleware, admission.queue_place_middleware]
    if config.access_log:
        access_log.enable_access_log()
    app = web.Application(client_max_size=body_limit(limits.max_upload_bytes), middlewares=middlewares)
    app[CONFIG] = config
    app[DRAIN] = drain
    app[READINESS_CHECKS] = [lambda: drain_readiness(drain)]  # 503 "draining" once the drain begins
    app[RESOLVE] = resolve
    app[LIMITER] = StreamLimiter(limits.max_streams_per_key, limits.max_keyless_streams)
    app[REGISTRATION_RATE] = routes_voices.registration_rate(limits)
    app[WEBSOCKETS] = weakref.WeakSet()
    app.on_response_prepare.append(admission.add_queue_headers)  # X-Queue-Position, X-Expected-Start-S
    app[DEFAULT_VOICE] = DefaultVoice(config.default_voice)
    app.cleanup_ctx.extend([_voice_store, _triton, _default_voice])
    if config.official_grpc_port is not None:  # imported only then: the generated protobuf code checks its runtime
        from .official_grpc import serve_official_grpc

        app.cleanup_ctx.append(serve_official_grpc)
    if config.official_triton_port is not None:
        from .triton_facade import serve_official_triton

        app.cleanup_ctx.append(serve_official_triton)
    routes_tts.add_routes(app)
    routes_vc.add_routes(app)
    routes_ws.add_routes(app)
    routes_openai.add_routes(app)
    routes_official.add_routes(app)
    routes_kserve.add_routes(app)
    routes_voices.add_routes(app)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", index)
    if config.static_dir.is_dir():
        app.router.add_static("/static/", config.static_dir)
    return app


# ---- resources ------------------------------------------------------------------------------------------

async def _voice_store(app: web.Application):
    from cosyvoice_triton.voices.stores import open_voice_store
    from cosyvoice_triton.server.launcher import resolve_voice_store

    config = app[CONFIG]
    store = await asyncio.to_thread(open_voice_store, resolve_voice_store(config.voice_store))
    app[STORE] = store
    app[COSTS] = await asyncio.to_thread(CostModel.from_model_dir, config.model_dir)
    yield
    await asyncio.to_thread(store.close)


async def _triton(app: web.Application):
    config = app[CONFIG]
    servers = [Server(target, TritonClient(target.grpc)) for target in config.triton]
    router = Router(servers, config.routing, config.family, models=config.models, discovery=config.discovery,
                    resolve=app[RESOLVE])
    app[ROUTER] = router
    app[METRICS] = GatewayMetrics(router)
    router.on_leave = app[METRICS].forget_server
    await router.check_all()
    for server in router.servers:
        if not server.healthy:
            log.warning("Triton %s is not ready yet; it joins the pool when it is", server.name)
    tasks = [asyncio.create_task(router.run_health()), asyncio.create_task(router.run_scrapes())]
    if config.discovery:  # first lookup at once, in the loop: a slow or failing DNS must not hold up the start
        tasks.append(asyncio.create_task(router.run_discovery()))
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with suppress(asyncio.CancelledError):
            await task
    await router.close()


async def _default_voice(app: web.Application):
    state, store, router = app[DEFAULT_VOICE], app[STORE], app[ROUTER]

    async def exists() -> bool:
        """The voice is there, and if it is the shipped one, with its recording (one stored by 0.1.0 has none:
        registering the recording again keeps it on the voice, so other families' features can be made)."""
        from cosyvoice_triton.errors import NotFound

        try:
            info = await asyncio.to_thread(store.info, "default")
        except NotFound:
            return False
        return info.has_recording or info.text != DEFAULT_TRANSCRIPT

    async def register(audio: bytes, text: str, voice_id: str) -> None:
        await routes_voices.register(app, audio, text, voice_id, name="default", owner=None)  # shared

    task = None
    if state.pending:
        task = asyncio.create_task(state.ensure(exists, register, lambda: bool(router.healthy())))
    yield
    if task is not None:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


# ---- middleware and plain routes --------------------------------------------------------------------------

def report_middleware(access_lines: bool = True):
    """How each request ended, decided once (request_keys.handle_and_report), counted in
    cosyvoice_gateway_requests_total and written in its access line (`access_lines`): the two never disagree."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if access_lines:
            access_log.begin(request)

        def report(route: str, status: str) -> None:
            metrics_ = request.app.get(METRICS)
            if metrics_ is not None:
                metrics_.requests.labels(route, status).inc()
                if request.get(ERROR_CODE):
                    metrics_.errors.labels(request[ERROR_CODE]).inc()
            access_log.write(request, route, status)

        return await handle_and_report(request, handler, report)

    return middleware


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


STORE_CHECK_TIMEOUT_S = 2.0


async def readyz(request: web.Request) -> web.Response:
    """Ready: at least one Triton server in the pool, the voice store answering, and the default voice
    settled. `family`: the model family of a request that names none (the servers' when they serve one);
    `families`: every family the pool's servers serve; `servers`: the pool's members now (with dns:// specs, what
    DNS names), healthy or not;
    `precision`: what each server's LLM and flow compute in (their metrics, as scraped; `auto` resolved);
    `voice_store`: "ok", or why not (`voice_store_error`, e.g. Redis is down); `capacity`: each scraped server's
    audio seconds per second (`measured` false: its cold default), the streams it keeps ahead of their
    listeners and the streams it has (gateway/routing.py `capacity_view`)."""
    router, voice = request.app[ROUTER], request.app[DEFAULT_VOICE]
    servers = {b.name: b.healthy for b in router.servers}
    store_error = await voice_store_error(request.app[STORE])
    extra = [check() for check in request.app.get(READINESS_CHECKS, ())]  # (waits, body parts): up's
    ready = any(servers.values()) and voice.settled and store_error is None and not any(w for w, _ in extra)
    waiting = [*(f"tritonserver {name}" for name, ok in servers.items() if not ok),
               *([] if servers else ["a tritonserver (none in the pool yet)"]),
               *([] if voice.settled else ["the default voice"]), *([] if store_error is None else ["the voice store"]),
               *(w for waits, _ in extra for w in waits)]
    body = {"status": "ready" if ready else "starting", "waiting_for": [] if ready else waiting, "ready": ready,
            "version": __version__, "family": router.family_for(None), "families": router.families,
            "servers": servers,
            "default_voice": voice.state,
            "voice_store": "ok" if store_error is None else "unavailable",
            "precision": {b.name: b.precision for b in router.servers if b.precision},
            "capacity": capacity_view(router.servers)}
    for _, parts in extra:
        body.update(parts)  # e.g. "processes" (up's supervisor), "status": "draining"
    if is_random(request.app[CONFIG].model_dir):
        body["model"] = RANDOM_NOTE
    if voice.error:
        body["default_voice_error"] = voice.error
    if store_error is not None:
        body["voice_store_error"] = store_error
    return web.json_response(body, status=200 if ready else 503)


async def voice_store_error(store) -> str | None:
    """Why the voice store does not answer now, or None."""
    try:
        await asyncio.wait_for(asyncio.to_thread(store.check), STORE_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"the voice store did not answer within {STORE_CHECK_TIMEOUT_S:g} s"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"{type(exc).__name__}: {exc}"
    return None


async def metrics(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def index(request: web.Request) -> web.StreamResponse:
    page = request.app[CONFIG].static_dir / "index.html"
    if page.is_file():
        return web.FileResponse(page)
    router = request.app[ROUTER]
    families = router.families or [router.family_for(None)]  # what a request's `model` may name
    return web.json_response({"service": "cosyvoice-triton gateway", "families": families, "endpoints": [
        "POST /v1/tts", "GET /v1/tts/ws (WebSocket)", "POST /v1/audio/speech", "GET /v1/models", "POST /v1/voices",
        "GET /v1/voices",
        "GET /v1/voices/{id}", "DELETE /v1/voices/{id}", "GET /healthz", "GET /readyz", "GET /metrics",
        "GET|POST /inference_{sft,zero_shot,cross_lingual,instruct,instruct2}",
        f"POST /v2/models/{{{','.join(router.synthesis_models())}}}/infer (KServe v2 JSON)"]})


# ---- serving --------------------------------------------------------------------------------------------

def run(config: GatewayConfig, app: web.Application | None = None, *, drain_timeout_s: float = DRAIN_TIMEOUT_S,
        out: TextIO = sys.stdout) -> int:
    """Serve until SIGINT / SIGTERM, then drain (gateway/serving.py `serve_until_stopped`, as `up` does): new
    requests get 503 + Retry-After, the ones in flight get `drain_timeout_s` to finish (what is left is cut
    after CUT_AFTER_DRAIN_S more); the exit code (0)."""
    print(f"cosyvoice-triton gateway on {config.url} (drains up to {drain_timeout_s:g} s + "
          f"{CUT_AFTER_DRAIN_S:g} s on SIGTERM)", file=out, flush=True)
    return asyncio.run(serve_until_stopped(app or create_app(config), config.host, config.port, drain_timeout_s,
                                           out))
