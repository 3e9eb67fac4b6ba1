"""`bench --compare AXIS`: the same scenario, concurrency levels and seeds for every variant of one axis,
in one run and one report.

- `voice_cache`: the voice by registered id (prompt features cached in the voice store) / the prompt
  recording sent with every request (encoded every time); one server.
- `chunk_policy`: the server's chunk policy / a small first chunk / large fixed chunks, sent as the
  per-request overrides `chunk_first_hop`, `chunk_hop_scale`, `chunk_max_hop` (gRPC inputs, or fields of
  the gateway's /v1/tts body and WebSocket start message); one server.
- `adaptive_chunks`: the `fixed` (official) chunk schedule / the `adaptive` one, sent as the per-request
  `chunk_policy`; one server, the variants interleaved round by round (at each concurrency c: c requests
  of fixed, then the same c seeds with adaptive, and again), so that both see the same load on a shared
  machine.
- `llm_batching`: `llm_max_batch` 8 (the default) / 1; one server per variant, in turn.
- `engine`: token2wav on torch / ONNX Runtime (/ TensorRT with `--device cuda`); one server per variant,
  in turn.

Variants that need a different server each get their own, started after the previous one stopped (two
servers at once would share the CPU and spoil both measurements). Those axes need `--start`; the others
also run against `--triton` or `--gateway`, on any path.
"""
from __future__ import annotations

import itertools
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cosyvoice_triton.perf import loadgen, report, serving
from cosyvoice_triton.perf.scenarios import Scenario

AXES = ("voice_cache", "chunk_policy", "adaptive_chunks", "llm_batching", "engine")
SERVER_AXES = ("llm_batching", "engine")  # variants that differ in how the server is started
INTERLEAVED_AXES = ("adaptive_chunks",)  # variants take turns at each level instead of running one after another

# (name, what it is, per-request overrides of the `cosyvoice2` model; see pipeline/chunk_policy.py)
CHUNK_POLICIES = (
    ("default", "the server's policy: first hop 25 tokens (+ the prompt alignment pad), then x2 up to 100", {}),
    ("small-first", "first hop 10 tokens, then x2 up to 100: earlier first audio, more flow calls",
     {"chunk_first_hop": 10}),
    ("fixed-50", "every hop 50 tokens (2 s of audio): fewer flow calls, later first audio",
     {"chunk_first_hop": 50, "chunk_hop_scale": 1.0, "chunk_max_hop": 50}),
)


@dataclass(frozen=True)
class Variant:
    name: str  # in the table and the plot legends
    description: str
    voice_mode: str = "id"  # see loadgen.VOICE_MODES
    options: dict = field(default_factory=dict)  # per-request overrides
    server: dict = field(default_factory=dict)  # ServeOptions fields of the server it needs

    def settings(self) -> dict:
        return {"voice_mode": self.voice_mode, "options": self.options, "server": self.server}


def plan(axis: str, *, device: str = "cpu", voice_mode: str = "id") -> list[Variant]:
    """The variants of `axis`; `voice_mode` is used wherever the axis does not vary it."""
    if axis == "voice_cache":
        return [Variant("id (cached)", "a registered voice id: prompt features read from the voice store",
                        voice_mode="id"),
                Variant("audio (every request)", "the prompt recording with every request: encoded each time",
                        voice_mode="audio")]
    if axis == "chunk_policy":
        return [Variant(name, description, voice_mode, options=dict(options))
                for name, description, options in CHUNK_POLICIES]
    if axis == "adaptive_chunks":
        return [Variant("fixed", "the official schedule: first hop 25 tokens (+ pad), then x2 up to 100", voice_mode,
                        options={"chunk_policy": "fixed"}),
                Variant("adaptive", "hops grow while the listener is ahead (up to 400), go back to 25 when its "
                        "lead runs low", voice_mode, options={"chunk_policy": "adaptive"})]
    if axis == "llm_batching":
        from cosyvoice_triton.server.launcher import ServeOptions

        default = ServeOptions.llm_max_batch
        return [Variant(f"llm batch {default}", f"the LLM decodes up to {default} streams per step (default)",
                        voice_mode, server={"llm_max_batch": default}),
                Variant("llm batch 1", "the LLM decodes one stream at a time; the others wait in its queue",
                        voice_mode, server={"llm_max_batch": 1})]
    if axis == "engine":
        engines = ["torch", "onnxruntime"] + (["tensorrt"] if device.startswith("cuda") else [])
        return [Variant(engine, f"token2wav (flow and HiFT) on {engine}", voice_mode, server={"engine": engine})
                for engine in engines]
    raise ValueError(f"unknown axis {axis!r}; known: {', '.join(AXES)}")


def unsupported(axis: str, settings: serving.Settings) -> str | None:
    """Why `axis` cannot run with `settings`, or None."""
    if axis in SERVER_AXES and not settings.start:
        return f"--compare {axis} starts a server per variant: use --start"
    return None


def server_groups(variants: list[Variant]) -> list[tuple[dict, list[Variant]]]:
    """Consecutive variants that can share one server, with that server's overrides."""
    def key(variant: Variant) -> tuple:
        return tuple(sorted(variant.server.items()))

    return [(dict(k), list(group)) for k, group in itertools.groupby(variants, key=key)]


@dataclass
class VariantResult:
    variant: Variant
    levels: list[dict] = field(default_factory=list)  # LevelResult.summary() per concurrency
    target: str = ""
    server_version: str | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # why the variant did not run

    def as_dict(self) -> dict:
        return {"name": self.variant.name, "description": self.variant.description, **self.variant.settings(),
                "target": self.target, "server_version": self.server_version, "notes": self.notes,
                "error": self.error, "levels": self.levels}


@dataclass(frozen=True)
class Load:
    """What every variant runs: the same cases, levels, requests and (through loadgen) seeds."""

    scenario: Scenario
    concurrency: list[int]
    requests: int
    warmup: int
    start_buffer_s: float = loadgen.DEFAULT_START_BUFFER_S  # of the second stall figure


def _describe(variant: Variant) -> str:
    parts = [f"voice by {variant.voice_mode}"]
    parts += [f"{k}={v}" for k, v in {**variant.options, **variant.server}.items()]
    return ", ".join(parts)


def _measure(endpoint: serving.Endpoint, variant: Variant, load: Load) -> VariantResult:
    print(f"variant {variant.name} ({_describe(variant)}) on {endpoint.describe()}", file=sys.stderr, flush=True)
    levels = loadgen.measure(endpoint.target, list(load.scenario.cases), load.concurrency, load.requests,
                             voice_mode=variant.voice_mode, warmup=load.warmup, options=variant.options,
                             on_level=lambda level: print(f"[{variant.name}] {loadgen.progress_line(level)}",
                                                          flush=True), start_buffer_s=load.start_buffer_s)
    return VariantResult(variant, [level.summary() for level in levels], endpoint.describe(),
                         endpoint.server_version, serving.engine_warnings(endpoint.server_log))


def _measure_interleaved(endpoint: serving.Endpoint, variants: list[Variant], load: Load) -> list[VariantResult]:
    """Level by level and, in each level, round by round: `concurrency` requests of each variant in turn,
    with the same seeds, until each variant has made `requests` (the warm-up before its first round only)."""
    results = [VariantResult(v, target=endpoint.describe(), server_version=endpoint.server_version,
                             notes=serving.engine_warnings(endpoint.server_log)) for v in variants]
    cases = list(load.scenario.cases)
    for n, concurrency in enumerate(load.concurrency):
        merged = [loadgen.LevelResult(concurrency, 0.0, [], load.start_buffer_s) for _ in variants]
        for done in range(0, load.requests, concurrency):
            for variant, level in zip(variants, merged):
                (one,) = loadgen.measure(endpoint.target, cases, [concurrency], min(concurrency, load.requests - done),
                                         voice_mode=variant.voice_mode, options=variant.options,
                                         warmup=load.warmup if n == done == 0 else 0,
                                         start_buffer_s=load.start_buffer_s, seed=100_000 * (n + 1) + done)
                level.wall_s += one.wall_s
                level.requests += one.requests
        for result, level in zip(results, merged):
            print(f"[{result.variant.name}] {loadgen.progress_line(level)}", flush=True)
            result.levels.append(level.summary())
    return results


def run_variants(settings: serving.Settings, variants: list[Variant], load: Load, work_dir: Path,
                 interleave: bool = False) -> list[VariantResult]:
    """Every variant in order, each group on its own deployment (server folders under `work_dir`).
    A variant that cannot run (its server or gateway did not start, its voice did not register) is
    marked failed, with the variants after it in its group; the other groups still run."""
    from cosyvoice_triton.client.common import TTSError
    from cosyvoice_triton.errors import CosyVoiceError

    results: list[VariantResult] = []
    for n, (server, group) in enumerate(server_groups(variants)):
        done = len(results)
        try:
            with serving.deployment(settings, work_dir / f"server-{n}", server) as endpoint:
                if interleave:
                    results += _measure_interleaved(endpoint, group, load)
                else:
                    for variant in group:
                        results.append(_measure(endpoint, variant, load))
        except (CosyVoiceError, TTSError, TimeoutError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            first_line = next(iter(str(exc).splitlines()), "")  # TritonStartError appends the log's tail
            message = f"{type(exc).__name__}: {first_line}"[:300]
            results += [VariantResult(v, error=message) for v in group[len(results) - done:]]
    return results


def run(axis: str, settings: serving.Settings, load: Load, *, voice_mode: str, model: str, out: Path) -> int:
    """The comparison of `axis`, its report in `out`; exit code 0, 1 (a request or variant failed) or 2."""
    problem = unsupported(axis, settings)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    variants = plan(axis, device=settings.device, voice_mode=voice_mode)
    print(f"compare {axis} on {load.scenario.name}: {', '.join(v.name for v in variants)}; concurrency "
          f"{load.concurrency}, {load.requests} requests per level", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="cosyvoice-bench-") as tmp:
        results = run_variants(settings, variants, load, Path(tmp), interleave=axis in INTERLEAVED_AXES)
    where = "servers started here" if settings.start else settings.url
    env = report.environment(scenario=load.scenario.name, scenario_description=load.scenario.description,
                             compare=axis, target=f"{settings.path} path, {where}",
                             voice_mode="varies" if axis == "voice_cache" else voice_mode, model=model,
                             server_version=next((r.server_version for r in results if r.server_version), None),
                             requests_per_level=load.requests,
                             prompt_source=load.scenario.cases[0].prompt_source)
    paths = report.write_comparison([r.as_dict() for r in results], env, out)
    print(f"report: {paths['markdown']}", flush=True)
    failed = any(r.error for r in results) or any(level["errors"] for r in results for level in r.levels)
    return 1 if failed else 0
