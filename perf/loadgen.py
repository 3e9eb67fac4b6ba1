"""Closed-loop load generator (asyncio) against Triton gRPC or the gateway.

For each concurrency level, `concurrency` clients each send a request, read its stream to the end and
send the next, until `requests` requests of that level are done. Each request records the time to the
first and second audio chunk (from sending it), to its first audible audio (the arrival of the chunk
holding its first sample above -50 dBFS over 10 ms: cosyvoice_triton/pipeline/audible.py, its default
threshold), its total time, its audio seconds and every chunk's arrival time and length; a level reports
their p50/p90/p99, RTF (level wall time / audio seconds made),
throughput (audio seconds per second) and the playback stalls of its streams (`stats.stall_summary`:
a listener that starts at the first chunk, and one that starts `start_buffer_s` after it).

Targets, one per path (`make_target`):
- `grpc`, `GrpcTarget("host:8001")`: the `cosyvoice2` decoupled model through `AsyncTritonTTS` (one
  `ModelStreamInfer` call per request).
- `http`, `GatewayTarget("http://host:8080")`: `POST /v1/tts` with `stream: true` through `AsyncGatewayTTS`.
- `ws`, `GatewayWsTarget("http://host:8080")`: a `WS /v1/tts/ws` session per request through
  `AsyncGatewayTTS.stream_ws` (start message with the text, then end; binary PCM frames back; the
  gateway ends with its stats and closes). The first chunk is the first binary frame.

Voice mode `id` registers each distinct prompt once before the run and sends its id; `audio` sends the
prompt recording with every request (the prompt is then encoded, or fetched from the server's cache,
per request). Per-request options (the chunk policy overrides `chunk_first_hop`, `chunk_hop_scale`,
`chunk_max_hop`) go with every request on every path: as gRPC inputs, as fields of the /v1/tts body, or
in the WebSocket start message.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cosyvoice_triton.client.common import SAMPLE_RATE, wav_bytes
from cosyvoice_triton.client.gateway_aio import AsyncGatewayTTS
from cosyvoice_triton.client.triton_client import AsyncTritonTTS
from cosyvoice_triton.pipeline.audible import AudibleDetector
from cosyvoice_triton.perf.scenarios import Case
from cosyvoice_triton.perf.stats import (DEFAULT_START_BUFFER_S, RequestResult, percentile,  # noqa: F401
                                         stall_summary)

VOICE_MODES = ("id", "audio")
PATHS = ("grpc", "http", "ws")  # direct Triton gRPC; the gateway's streamed POST /v1/tts; its WebSocket


@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    requests: list[RequestResult] = field(default_factory=list)
    start_buffer_s: float = DEFAULT_START_BUFFER_S  # of the second stall figure

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.requests) - len(self.ok)

    @property
    def audio_s(self) -> float:
        return sum(r.audio_s for r in self.ok)

    def _times(self, name: str) -> list[float]:
        return [getattr(r, name) for r in self.ok if getattr(r, name) is not None]

    def summary(self) -> dict:
        """Plain numbers (seconds) for the report and results.json."""
        first, second, total = self._times("first_chunk_s"), self._times("second_chunk_s"), self._times("total_s")
        audible = self._times("first_audible_s")
        out = {"concurrency": self.concurrency, "requests": len(self.requests), "errors": self.errors,
               "wall_s": self.wall_s, "audio_s": self.audio_s,
               "rtf": self.wall_s / self.audio_s if self.audio_s else None,
               "throughput": self.audio_s / self.wall_s if self.wall_s else None,
               "first_error": next((r.error for r in self.requests if r.error), None)}
        for label, values in (("first_chunk", first), ("first_audible", audible), ("second_chunk", second),
                              ("total", total)):
            for q in (50, 90, 99):
                out[f"{label}_p{q}_s"] = percentile(values, q)
        return {**out, **stall_summary(self.ok, self.start_buffer_s)}


class GrpcTarget:
    """Direct gRPC to the `cosyvoice2` model."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url
        self.client = AsyncTritonTTS(url, timeout_s=timeout_s)

    async def register(self, case: Case) -> str:
        voice = await self.client.register_voice(case.prompt_audio, sample_rate=case.prompt_rate,
                                                 prompt_text=case.prompt_text or None)
        return voice.voice_id

    async def stream(self, case: Case, voice_id: str | None, seed: int, options: dict):
        if voice_id is not None:
            return self.client.stream(case.text, voice_id=voice_id, mode=case.mode, seed=seed, **options)
        return self.client.stream(case.text, prompt_audio=case.prompt_audio, prompt_sample_rate=case.prompt_rate,
                                  prompt_text=case.prompt_text if case.mode == "zero_shot" else None,
                                  mode=case.mode, seed=seed, **options)

    async def close(self) -> None:
        await self.client.close()


class GatewayTarget:
    """The HTTP gateway's streamed `/v1/tts`."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0):
        self.url = url
        self.client = AsyncGatewayTTS(url, api_key=api_key, timeout_s=timeout_s)

    async def register(self, case: Case) -> str:
        voice = await self.client.add_voice(wav_bytes(case.prompt_audio, case.prompt_rate), case.prompt_text)
        return voice.voice_id

    def _voice(self, case: Case, voice_id: str | None) -> dict:
        if voice_id is not None:
            return {"voice_id": voice_id}
        return {"prompt_audio": wav_bytes(case.prompt_audio, case.prompt_rate),
                "prompt_text": case.prompt_text if case.mode == "zero_shot" else None}

    async def stream(self, case: Case, voice_id: str | None, seed: int, options: dict):
        return await self.client.stream(case.text, mode=case.mode, seed=seed, **self._voice(case, voice_id),
                                        **options)

    async def close(self) -> None:
        await self.client.close()


class GatewayWsTarget(GatewayTarget):
    """The gateway's `WS /v1/tts/ws`: one session per request, the whole text in its start message."""

    async def stream(self, case: Case, voice_id: str | None, seed: int, options: dict):
        return await self.client.stream_ws(case.text, mode=case.mode, seed=seed, **self._voice(case, voice_id),
                                           **options)


def make_target(path: str, url: str, api_key: str | None = None, timeout_s: float = 600.0):
    """The target of `path` (one of `PATHS`) at `url` (host:port for grpc, the gateway's base URL otherwise);
    `timeout_s` is the client's deadline for one whole request."""
    if path == "grpc":
        return GrpcTarget(url, timeout_s=timeout_s)
    if path == "http":
        return GatewayTarget(url, api_key=api_key, timeout_s=timeout_s)
    if path == "ws":
        return GatewayWsTarget(url, api_key=api_key, timeout_s=timeout_s)
    raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")


async def one_request(target, case: Case, voice_id: str | None, seed: int, options: dict | None = None
                      ) -> RequestResult:
    result = RequestResult()
    started = time.monotonic()
    audible: AudibleDetector | None = None
    try:
        stream = await target.stream(case, voice_id, seed, options or {})
        async with stream:
            async for chunk in stream:
                now = time.monotonic() - started
                if audible is None:  # the stream's sample rate is known once it has started
                    audible = AudibleDetector(getattr(stream.stats, "sample_rate", SAMPLE_RATE))
                audible.feed(chunk, now)
                if result.chunks == 0:
                    result.first_chunk_s = now
                elif result.chunks == 1:
                    result.second_chunk_s = now
                result.chunks += 1
                seconds = chunk.size / getattr(stream.stats, "sample_rate", SAMPLE_RATE)
                result.audio_s += seconds
                result.arrivals.append(now)
                result.chunk_audio_s.append(seconds)
        if audible is not None:
            audible.finish()
            result.first_audible_s = audible.at
    except Exception as exc:  # noqa: BLE001 - counted per request, the run goes on
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.total_s = time.monotonic() - started
    return result


async def run_level(target, cases: list[Case], voice_ids: list[str | None], concurrency: int,
                    requests: int, seed: int = 0, options: dict | None = None,
                    start_buffer_s: float = DEFAULT_START_BUFFER_S) -> LevelResult:
    """`requests` requests by `concurrency` closed-loop clients; cases are taken round-robin."""
    counter = iter(range(requests))
    results: list[RequestResult] = []

    async def client() -> None:
        for k in counter:  # a shared iterator: each request index is taken once
            case, voice_id = cases[k % len(cases)], voice_ids[k % len(cases)]
            results.append(await one_request(target, case, voice_id, seed + k, options))

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return LevelResult(concurrency, time.monotonic() - started, results, start_buffer_s)


def progress_line(level: LevelResult) -> str:
    s = level.summary()

    def ms(key: str) -> str:
        return "-" if s[key] is None else f"{1000 * s[key]:.0f}"

    rtf = "-" if s["rtf"] is None else f"{s['rtf']:.3f}"
    share = "-" if s["stall_share"] is None else f"{100 * s['stall_share']:.0f}%"
    return (f"concurrency {s['concurrency']:>3}: {s['requests']} requests, {s['errors']} errors, "
            f"first chunk p50/p90/p99 {ms('first_chunk_p50_s')}/{ms('first_chunk_p90_s')}/{ms('first_chunk_p99_s')} ms, "
            f"first audible p50 {ms('first_audible_p50_s')} ms, "
            f"RTF {rtf}, {s['audio_s']:.1f} s audio in {s['wall_s']:.1f} s, "
            f"stalls in {share} of streams (p99 {ms('stall_p99_s')} ms per stream)")


async def run_load(target, cases: list[Case], concurrencies: list[int], requests: int, *, voice_mode: str = "id",
                   warmup: int = 1, options: dict | None = None,
                   on_level: Callable[[LevelResult], None] | None = None,
                   start_buffer_s: float = DEFAULT_START_BUFFER_S, seed: int | None = None) -> list[LevelResult]:
    """Every level in turn (after `warmup` unmeasured requests); `on_level` sees each as it finishes.
    Level n uses seeds 100000 * (n + 1) + k (or, given `seed`, seed + 100000 * n + k), so runs with the
    same levels send the same seeds."""
    if voice_mode not in VOICE_MODES:
        raise ValueError(f"voice_mode must be one of {', '.join(VOICE_MODES)}, got {voice_mode!r}")
    voice_ids: list[str | None] = [None] * len(cases)
    if voice_mode == "id":
        registered: dict[int, str] = {}
        for i, case in enumerate(cases):
            key = id(case.prompt_audio)
            if key not in registered:
                registered[key] = await target.register(case)
            voice_ids[i] = registered[key]
    for k in range(warmup):
        await one_request(target, cases[k % len(cases)], voice_ids[k % len(cases)], 10_000 + k, options)
    levels = []
    for n, concurrency in enumerate(concurrencies):
        first = 100_000 * (n + 1) if seed is None else seed + 100_000 * n
        level = await run_level(target, cases, voice_ids, concurrency, requests, seed=first,
                                options=options, start_buffer_s=start_buffer_s)
        levels.append(level)
        if on_level is not None:
            on_level(level)
    return levels


def measure(make: Callable[[], object], cases: list[Case], concurrencies: list[int], requests: int, *,
            voice_mode: str = "id", warmup: int = 1, options: dict | None = None,
            on_level: Callable[[LevelResult], None] | None = None,
            start_buffer_s: float = DEFAULT_START_BUFFER_S, seed: int | None = None) -> list[LevelResult]:
    """`run_load` in an event loop of its own, on a target that `make()` builds inside that loop (gRPC
    and aiohttp clients belong to the loop that made them) and that is closed at the end."""
    async def go() -> list[LevelResult]:
        target = make()
        try:
            return await run_load(target, cases, concurrencies, requests, voice_mode=voice_mode, warmup=warmup,
                                  options=options, on_level=on_level, start_buffer_s=start_buffer_s, seed=seed)
        finally:
            await target.close()

    return asyncio.run(go())
