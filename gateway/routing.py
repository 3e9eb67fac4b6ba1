"""Which Triton server takes a request: least outstanding cost among the healthy ones.

Cost (`CostModel`, in "speech-token steps"): a request costs
    SPEECH_PER_TEXT_TOKEN * text tokens   (LLM decode steps and token2wav work grow with the output)
  + PROMPT_WEIGHT * prompt speech tokens  (LLM prefill and the flow's attention over the prompt)
  + ENCODE_COST when the prompt is raw audio (the prompt encoder runs) + BASE_COST.
Text tokens come from the model's tokenizer when the gateway knows the model folder, else from a
bytes/4 estimate.

A server's load is this gateway's own accounting (the cost of the requests it has in flight there)
plus what the server's metrics show beyond them: `nv_inference_pending_request_count` (queued in
Triton) and `cosyvoice_active_streams` (being synthesized) of `cosyvoice2`, scraped every few seconds,
less this gateway's own requests there, times the mean request cost. So requests that other gateways
sent count too. Ties go to the server picked least recently.

Health: a background loop asks each server ServerReady + ModelReady(cosyvoice2). A failing server
leaves the pool (also at once when a call to it fails at the transport level) and comes back when it
answers ready again.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from cosyvoice_triton.prometheus_text import metric_sum

from .config import RoutingConfig, TritonTarget
from .errors import ServiceUnavailable
from .triton_client import TritonClient

log = logging.getLogger(__name__)

SPEECH_PER_TEXT_TOKEN = 10.0
PROMPT_WEIGHT = 0.5
ENCODE_COST = 25.0
BASE_COST = 25.0
TOKENS_PER_SECOND = 25  # prompt speech tokens per second of prompt audio


class CostModel:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer  # a TextTokenizer, or None

    @classmethod
    def from_model_dir(cls, model_dir: Path | None) -> CostModel:
        if model_dir is None:
            return cls()
        from cosyvoice_triton.config import ModelPaths
        from cosyvoice_triton.frontend.tokenizer import TextTokenizer

        try:
            return cls(TextTokenizer.from_dir(ModelPaths(Path(model_dir)).qwen_dir))
        except Exception as exc:  # noqa: BLE001 - estimates still work without it
            log.warning("no tokenizer from %s (%s): text cost from byte counts", model_dir, exc)
            return cls()

    def text_tokens(self, text: str) -> int:
        if self.tokenizer is not None:
            return self.tokenizer.count(text)
        return max(1, len(text.encode("utf-8")) // 4)

    def estimate(self, text: str, prompt_tokens: int, encodes_prompt: bool) -> float:
        return (SPEECH_PER_TEXT_TOKEN * self.text_tokens(text) + PROMPT_WEIGHT * prompt_tokens
                + (ENCODE_COST if encodes_prompt else 0.0) + BASE_COST)


@dataclass(eq=False)
class Backend:
    target: TritonTarget
    client: TritonClient
    healthy: bool = False
    outstanding_cost: float = 0.0  # this gateway's requests in flight there
    inflight: int = 0
    external: float = 0.0  # requests there that this gateway did not send (from the last scrape)
    pending: float = 0.0  # nv_inference_pending_request_count of the synthesis model (last scrape)
    last_pick: int = 0

    @property
    def name(self) -> str:
        return self.target.name


class Router:
    def __init__(self, backends: list[Backend], routing: RoutingConfig, model: str, on_change=None):
        if not backends:
            raise ValueError("no Triton servers")
        self.backends = backends
        self.routing = routing
        self.model = model
        self.mean_cost = BASE_COST + 10 * SPEECH_PER_TEXT_TOKEN
        self._picks = itertools.count(1)
        self._on_change = on_change  # called with (backend, healthy) when a server leaves or rejoins

    # ---- choosing ------------------------------------------------------------------------------------
    def load(self, backend: Backend) -> float:
        return backend.outstanding_cost + backend.external * self.mean_cost

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def pick(self, exclude: Iterable[Backend] = ()) -> Backend:
        excluded = set(exclude)
        candidates = [b for b in self.backends if b.healthy and b not in excluded]
        if not candidates:
            raise ServiceUnavailable("no healthy Triton server can take the request" if not excluded else
                                     "every Triton server tried failed before the first audio")
        chosen = min(candidates, key=lambda b: (self.load(b), b.last_pick))
        chosen.last_pick = next(self._picks)
        return chosen

    @contextmanager
    def lease(self, backend: Backend, cost: float) -> Iterator[Backend]:
        """Count `cost` against `backend` while the block runs."""
        self.mean_cost = 0.9 * self.mean_cost + 0.1 * cost
        backend.outstanding_cost += cost
        backend.inflight += 1
        try:
            yield backend
        finally:
            backend.outstanding_cost = max(0.0, backend.outstanding_cost - cost)
            backend.inflight -= 1

    # ---- health and load --------------------------------------------------------------------------------
    def set_health(self, backend: Backend, healthy: bool, reason: str = "") -> None:
        if backend.healthy == healthy:
            return
        backend.healthy = healthy
        # Its last scrape described a server that is gone or was down: forget it, so a stale count of
        # streams that died with it does not steer requests away once it is back (the next scrape refills).
        backend.external = backend.pending = 0.0
        if healthy:
            log.info("Triton %s is ready: back in the pool", backend.name)
        else:
            log.warning("Triton %s left the pool: %s", backend.name, reason or "not ready")
        if self._on_change is not None:
            self._on_change(backend, healthy)

    async def check(self, backend: Backend) -> bool:
        ok = await backend.client.ready(self.model, self.routing.health_timeout_s)
        self.set_health(backend, ok, "not ready (health check)")
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends))

    async def scrape(self, backend: Backend, session: aiohttp.ClientSession) -> None:
        timeout = aiohttp.ClientTimeout(total=self.routing.health_timeout_s)
        try:
            async with session.get(backend.target.metrics_url, timeout=timeout) as response:
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return  # health checks decide about the server; the load estimate just keeps its last value
        pending = metric_sum(text, "nv_inference_pending_request_count", self.model)
        active = metric_sum(text, "cosyvoice_active_streams", self.model)
        backend.pending = pending
        backend.external = max(0.0, pending + active - backend.inflight)

    async def run_health(self) -> None:
        while True:
            await asyncio.sleep(self.routing.health_interval_s)
            await self.check_all()

    async def run_scrapes(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.gather(*(self.scrape(b, session) for b in self.backends if b.healthy))
                await asyncio.sleep(self.routing.metrics_interval_s)

