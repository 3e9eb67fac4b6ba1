"""Which Triton server takes a request: the least outstanding cost, in real-time units, among the healthy ones
of the model family the request names (`Router`), with servers joining and leaving by health checks and DNS
discovery. A DNS name that fails to resolve keeps its current servers, and a channel is never closed under a
running health check. Each server's family is learned by its health check (which family's synthesis model it
has ready); a request's `model` names a family (`family_for`). The cost model, the load and membership:
docs/operations/overload.md#how-the-gateway-picks-a-server; families: docs/deployment/index.md.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from cosyvoice_triton.errors import NotFound, ParameterError, Unavailable
from cosyvoice_triton.admission import MEAN_COST, request_cost, text_tokens_estimate
from cosyvoice_triton.prometheus_text import metric_label, metric_sum
from cosyvoice_triton.server_pool import Server, ServerPool
from cosyvoice_triton.targets import Resolver, TritonTarget, discover, resolve_ips
from cosyvoice_triton.wire.names import FAMILY_MODELS

from .config import RoutingConfig
from .triton_channel import TritonClient

log = logging.getLogger(__name__)

LLM_MODEL, TOKEN2WAV_MODEL = "llm", "token2wav"  # the models cosyvoice2 calls (their metrics steer admission)
PRECISION_INFO = (("llm", "cosyvoice_llm_precision_info", LLM_MODEL),  # (part, metric, model): /readyz
                  ("flow", "cosyvoice_flow_precision_info", TOKEN2WAV_MODEL))


SynthesisPairs = dict[str, tuple[str, str]]  # family -> (streaming model, offline model)
SYNTHESIS_PAIRS: SynthesisPairs = {family: models[:2] for family, models in FAMILY_MODELS.items()}


def realtime_load(server: Server, cost: float, by_capacity: bool) -> tuple[bool, float]:
    """A server's place in the routing order (module docstring): (its real-time slots are all taken, its
    outstanding cost per unit of capacity, or plain cost when not every candidate's capacity is known)."""
    full = 0 < server.realtime_slots <= server.inflight + server.external
    return full, cost / server.capacity if by_capacity else cost


def capacity_view(servers: Iterable[Server]) -> dict[str, dict]:
    """/readyz's `capacity`: what each scraped server makes and keeps ahead, and the streams it has now."""
    return {s.name: {"audio_seconds_per_second": round(s.capacity, 3), "measured": s.capacity_measured,
                     "realtime_slots": s.realtime_slots, "streams": round(s.inflight + s.external, 1)}
            for s in servers if s.capacity > 0}


class CostModel:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer  # a TextTokenizer, or None

    @classmethod
    def from_model_dir(cls, model_dir: Path | None) -> CostModel:
        if model_dir is None:
            return cls()
        from cosyvoice_triton.config import ModelPaths
        from cosyvoice_triton.preprocess.tokenizer import TextTokenizer

        try:
            return cls(TextTokenizer.from_dir(ModelPaths(Path(model_dir)).qwen_dir))
        except Exception as exc:  # noqa: BLE001 - estimates still work without it
            log.warning("no tokenizer from %s (%s): text cost from byte counts", model_dir, exc)
            return cls()

    def text_tokens(self, text: str) -> int:
        if self.tokenizer is not None:
            return self.tokenizer.count(text)
        return text_tokens_estimate(text)

    def estimate(self, text: str, prompt_tokens: int, encodes_prompt: bool) -> float:
        return request_cost(self.text_tokens(text), prompt_tokens, encodes_prompt)


class Router:
    """The gateway's `ServerPool`, driven with asyncio: health checks, metric scrapes, DNS discovery."""

    def __init__(self, servers: list[Server], routing: RoutingConfig, family: str, on_change=None, *,
                 models: SynthesisPairs = SYNTHESIS_PAIRS, discovery: Sequence[str] = (),
                 resolve: Resolver = resolve_ips, new_client: Callable[[str], TritonClient] = TritonClient):
        if not servers and not discovery:
            raise ParameterError("no Triton servers")
        self.pool = ServerPool(servers, mean_cost=MEAN_COST, joins_healthy=False)
        self.routing = routing
        self.family = family  # a request's family when it names none and the servers serve several (or none yet)
        self.models = {**SYNTHESIS_PAIRS, **models}  # each family's synthesis models, as its servers name them
        # every name of each family (its own, its Triton models, the official form's): `model_family`
        self._names = {family: {family, *FAMILY_MODELS.get(family, ()), *pair} for family, pair in self.models.items()}
        self.discovery = tuple(discovery)  # dns:// specs
        self.on_leave: Callable[[Server], None] | None = None  # called when a discovered server leaves
        self._on_change = on_change  # called with (server, healthy) when a server leaves or rejoins
        self._resolve = resolve
        self._new_client = new_client  # grpc address -> TritonClient, for servers that join
        self._closing: set[asyncio.Task] = set()
        self._channels = asyncio.Lock()  # held by health checks and by channel closes
        self._fetched_at: dict[Server, float] = {}  # loop time each server's last good scrape began its fetch
        self._refreshes: dict[Server, asyncio.Task] = {}  # a scrape out of turn in flight, per server

    @property
    def servers(self) -> list[Server]:
        """The servers in the pool now (fixed ones, and discovered ones while DNS names them)."""
        return self.pool.servers

    @property
    def draining(self) -> list[Server]:
        """Servers gone from DNS with requests still running there (channel open)."""
        return self.pool.draining

    @property
    def mean_cost(self) -> float:
        return self.pool.mean_cost

    # ---- choosing ------------------------------------------------------------------------------------
    def load(self, server: Server) -> float:
        return self.pool.load(server)

    def healthy(self, family: str | None = None) -> list[Server]:
        """The healthy servers (of `family`; None: of any)."""
        return [s for s in self.pool.healthy() if family is None or s.family == family]

    def pick(self, exclude: Iterable[Server] = (), family: str | None = None) -> Server:
        """The least-loaded healthy server of `family` (None: of any) not in `exclude`."""
        tried = list(exclude)
        excluded = tried + [s for s in self.pool.servers if family is not None and s.family != family]
        candidates = [s for s in self.pool.healthy() if s not in excluded]
        by_capacity = bool(candidates) and all(s.capacity > 0 for s in candidates)
        chosen = self.pool.pick(excluded, lambda s: realtime_load(s, self.pool.load(s), by_capacity))
        if chosen is None:
            of = "" if family is None else f" of {family}"
            raise Unavailable(f"no healthy Triton server{of} can take the request" if not tried else
                              f"every Triton server{of} tried failed before the first audio")
        return chosen

    # ---- families --------------------------------------------------------------------------------------
    @property
    def families(self) -> list[str]:
        """The families the pool's servers serve (healthy now or not, once a health check has seen them)."""
        known = {s.family for s in self.pool.servers if s.family is not None}
        return [family for family in self.models if family in known]

    def model_family(self, model: str) -> str | None:
        """The family a model name names: the family's own name or one of its Triton synthesis models (the official
        tensor form's too), in any case; None for any other name (register_voice, llm, OpenAI's tts-1, ...)."""
        name = model.strip().lower()
        return next((family for family, names in self._names.items() if name in names), None)

    def family_for(self, model: str | None, *, any_name: bool = False) -> str:
        """The family a request's `model` names (`model_family`); None, or with `any_name` a name of no family
        (OpenAI's tts-1): the family of the servers when they serve one, else `self.family`. A name of no family,
        or of a family no server serves: NotFound naming `model` (a family whose servers are all down is still
        served: the pick answers 503)."""
        served = self.families
        family = None if model is None else self.model_family(model)
        if family is None and (model is None or any_name):
            return served[0] if len(served) == 1 else self.family
        if family is None or (served and family not in served):
            what = f"no model {model!r}" if family is None else f"no {family} server is in the pool"
            raise NotFound("model", f"{what}: the models served are {', '.join(served or [self.family])}")
        return family

    def served_family(self, model: str, field: str = "model") -> str | None:
        """The family a Triton model name names (`model_family`), which a server must serve (`family_for`: else
        NotFound naming `field`); None for a model of no family (llm, register_voice, ...: any server has it)."""
        if self.model_family(model) is None:
            return None
        try:
            return self.family_for(model)
        except NotFound as exc:
            raise NotFound(field, exc.problem) from None

    def synthesis_models(self) -> dict[str, str]:
        """Each served family's streaming and offline synthesis models (none seen yet: the default family's), each
        -> its family: the model names the gateway answers KServe inference for."""
        return {model: family for family in self.families or [self.family] for model in self.models[family]}

    @contextmanager
    def lease(self, server: Server, cost: float) -> Iterator[Server]:
        """Count `cost` against `server` while the block runs."""
        self.pool.acquire(server, cost)
        try:
            yield server
        finally:
            if self.pool.release(server, cost):
                self._close_later(server)

    # ---- health and load --------------------------------------------------------------------------------
    def set_health(self, server: Server, healthy: bool, reason: str = "") -> None:
        # A change forgets the last scrape: it described a server that is gone or was down, so a stale
        # count of streams that died with it must not steer requests away once it is back.
        if not self.pool.set_health(server, healthy):
            return
        if healthy:
            log.info("Triton %s is ready: back in the pool", server.name)
        else:
            log.warning("Triton %s left the pool: %s", server.name, reason or "not ready")
        if self._on_change is not None:
            self._on_change(server, healthy)

    async def check(self, server: Server) -> bool:
        family = await self._ready_family(server)
        if family is not None:
            server.family = family
        self.set_health(server, family is not None, "not ready (health check)")
        return family is not None

    async def _ready_family(self, server: Server) -> str | None:
        """The family whose streaming model `server` has ready (the one it served last asked first), or None."""
        for family in dict.fromkeys([server.family or self.family, *self.models]):
            if await server.client.ready(self.models[family][0], self.routing.health_timeout_s):
                return family
        return None

    async def check_all(self) -> None:
        async with self._channels:
            await asyncio.gather(*(self.check(b) for b in self.servers))

    async def scrape(self, server: Server, session: aiohttp.ClientSession) -> None:
        timeout = aiohttp.ClientTimeout(total=self.routing.health_timeout_s)
        began = asyncio.get_running_loop().time()  # the view is as old as the fetch's start
        try:
            async with session.get(server.target.metrics_url, timeout=timeout) as response:
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return  # health checks decide about the server; the load estimate just keeps its last value
        model = self.models[server.family or self.family][0]  # its streaming model's series
        pending = metric_sum(text, "nv_inference_pending_request_count", model)
        active = metric_sum(text, "cosyvoice_active_streams", model)
        server.queued = metric_sum(text, "cosyvoice_queued_streams", model)
        server.pending = pending
        self.pool.set_external(server, pending + server.queued + active)
        server.capacity = metric_sum(text, "cosyvoice_capacity_audio_seconds_per_second", model)
        server.capacity_measured = metric_sum(text, "cosyvoice_capacity_measured", model) > 0
        server.realtime_slots = int(metric_sum(text, "cosyvoice_realtime_slots", model))
        server.slots = int(metric_sum(text, "cosyvoice_stream_slots", model))
        speed = metric_sum(text, "cosyvoice_seconds_per_cost", model)
        server.seconds_per_cost = speed if speed > 0 else None
        server.llm_free_slots = int(metric_sum(text, "cosyvoice_llm_free_slots", LLM_MODEL))
        server.llm_slots = server.llm_free_slots + int(metric_sum(text, "cosyvoice_llm_active_streams", LLM_MODEL))
        server.token2wav_pending = metric_sum(text, "nv_inference_pending_request_count", TOKEN2WAV_MODEL)
        server.precision = {part: value for part, name, model in PRECISION_INFO
                            if (value := metric_label(text, name, model, "precision")) is not None}
        self._fetched_at[server] = began

    async def refresh(self, server: Server) -> None:
        """Scrape `server` with a fetch begun after this call: between scrapes its count of the streams others
        sent there only grows stale (they end unseen), and a refusal must not rest on streams that have ended.
        A scrape whose fetch began before the call may have read a stream that ended since, however recently
        it finished. Callers that arrive together share one scrape; one in flight since before the call is
        awaited first, then a scrape of the caller's own is begun."""
        asked = asyncio.get_running_loop().time()
        for _ in range(2):
            if self._fetched_at.get(server, -math.inf) >= asked:
                return
            if server not in self._refreshes:
                self._refreshes[server] = asyncio.create_task(self._scrape_now(server))
            await asyncio.shield(self._refreshes[server])

    async def _scrape_now(self, server: Server) -> None:
        try:
            async with aiohttp.ClientSession() as session:
                await self.scrape(server, session)
        finally:
            del self._refreshes[server]

    async def run_health(self) -> None:
        while True:
            await asyncio.sleep(self.routing.health_interval_s)
            await self.check_all()

    async def run_scrapes(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.gather(*(self.scrape(b, session) for b in self.servers if b.healthy))
                await asyncio.sleep(self.routing.metrics_interval_s)

    # ---- membership (dns:// specs) ------------------------------------------------------------------------
    async def run_discovery(self) -> None:
        while True:
            await self.rediscover()
            await asyncio.sleep(self.routing.discovery_interval_s)

    async def rediscover(self) -> None:
        """Resolve every dns:// spec again and apply what it names now; servers that joined get their
        first health check before this returns."""
        joined: list[Server] = []
        for spec in self.discovery:
            found = await self._lookup(spec)
            if found:  # nothing found: keep the spec's servers (see the module docstring)
                joined += self._update(spec, found)
        if joined:
            async with self._channels:
                await asyncio.gather(*(self.check(b) for b in joined))

    async def _lookup(self, spec: str) -> list[TritonTarget]:
        try:
            found = await asyncio.to_thread(discover, [spec], "--triton", self._resolve)
        except Exception as exc:  # noqa: BLE001 - a resolver that raises is a DNS hiccup like any other
            log.warning("DNS %s failed (%s: %s): keeping its current servers", spec, type(exc).__name__, exc)
            return []
        if not found:
            log.warning("DNS %s resolved to no address: keeping its current servers", spec)
        return found

    def _update(self, spec: str, found: list[TritonTarget]) -> list[Server]:
        """Make the pool's servers from `spec` the ones in `found`; returns those that joined."""
        update = self.pool.update(spec, found, lambda target: self._new_client(target.grpc))
        for server in update.left:
            log.info("Triton %s is gone from %s: left the pool (%d requests still running there)",
                     server.name, spec, server.inflight)
            if self.on_leave is not None:
                self.on_leave(server)
        for server in update.idle:
            self._close_later(server)
        for server in update.joined:
            log.info("Triton %s found by %s: joins the pool when its health check passes", server.name, spec)
        return update.joined

    def _close_later(self, server: Server) -> None:
        task = asyncio.get_running_loop().create_task(self._close(server))
        self._closing.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._closing.discard)

    async def _close(self, server: Server) -> None:
        async with self._channels:
            await server.client.close()

    async def close(self) -> None:
        """Close every channel: members', and those of servers that left with requests still running."""
        await asyncio.gather(*self._closing, return_exceptions=True)
        clients = [b.client for b in self.pool.everyone()]
        self.pool.draining.clear()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
