"""The application's shared objects, under module-level `web.AppKey`s (set up in `app.create_app`)."""
from __future__ import annotations

import weakref

from aiohttp import web

from .auth import RateLimiter, StreamLimiter
from .config import GatewayConfig
from .default_voice import DefaultVoice
from .drain import Drain
from .metrics import GatewayMetrics
from .routing import CostModel, Router

CONFIG = web.AppKey("config", GatewayConfig)
RESOLVE = web.AppKey("resolve", object)  # a cosyvoice_triton.targets.Resolver: DNS lookups of dns:// specs
ROUTER = web.AppKey("router", Router)
STORE = web.AppKey("store", object)  # a cosyvoice_triton.voices.store.VoiceStore (blocking: use threads)
COSTS = web.AppKey("costs", CostModel)
METRICS = web.AppKey("metrics", GatewayMetrics)
LIMITER = web.AppKey("limiter", StreamLimiter)
REGISTRATION_RATE = web.AppKey("registration_rate", RateLimiter)  # POST /v1/voices per tenant
WEBSOCKETS = web.AppKey("websockets", weakref.WeakSet)
DEFAULT_VOICE = web.AppKey("default_voice", DefaultVoice)
DRAIN = web.AppKey("drain", Drain)  # begun by whoever stops the gateway (`up` on SIGTERM)
# Readiness conditions (create_app's drain, `up` adds its supervisor's): each `() -> (waits, body parts)`,
# not ready while `waits` (a list of what it waits for) is not empty; the parts go into /readyz's body.
READINESS_CHECKS = web.AppKey("readiness_checks", list)
