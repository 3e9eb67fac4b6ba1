"""Benchmark reports: `report.md` (environment + one table row per concurrency), `results.json`, and PNG
plots (`first_chunk.png`: first-chunk p50/p99 and first-audible p50 vs concurrency; `rtf_throughput.png`: RTF and audio
seconds per second vs concurrency), all in one folder per run.

A comparison (`write_comparison`) has the same layout: one table row per variant x concurrency,
results.json with the levels of each variant, and one line per variant in `first_chunk.png`
(first-chunk p50) and `throughput.png`.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path


def results_dir() -> Path:
    """Where a GPU script's report goes without --out: $COSYVOICE_PERF_RESULTS, else perf/results/ of the
    checkout (ignored by git)."""
    return Path(os.environ.get("COSYVOICE_PERF_RESULTS") or Path(__file__).resolve().parent / "results")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """GPU names from nvidia-smi (on this machine; the server may be elsewhere), or none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(**extra: object) -> dict:
    """Machine, versions and date; `extra` (target, model, scenario, ...) is merged in."""
    import os

    versions = {name: _version(name) for name in ("cosyvoice-triton", "cosyvoice_triton", "torch", "tritonclient",
                                                  "nvidia-pytriton", "numpy", "onnxruntime", "onnxruntime-gpu",
                                                  "tensorrt")}
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "gpu": ", ".join(gpu_names()) or "none",
            "python": platform.python_version(), "platform": platform.platform(),
            "versions": {k: v for k, v in versions.items() if v}, **extra}


def ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


TIMES_NOTE = ("Times in ms from sending the request; first audible: to the arrival of the chunk holding the "
              "first sample of the first 10 ms window above -50 dBFS (cosyvoice_triton/pipeline/audible.py; a "
              "first chunk that starts with silence is not heard sooner); RTF = level wall time / audio "
              "seconds made; throughput = audio seconds per second.")


STALL_HEADER = ("| streams with a stall | stall time per stream p50 / p99 | stalls per stream | worst stall "
                "| with a start buffer: streams with a stall / stall p99 |")


def stalls_note(summaries: list[dict]) -> str:
    buffer_ms = next((1000 * s["start_buffer_s"] for s in summaries if s.get("start_buffer_s") is not None), 200)
    return ("Stalls: a listener plays each stream's chunks back to back from the arrival of its first chunk "
            f"(and, with a start buffer, {buffer_ms:.0f} ms after it); a chunk that arrives after the audio "
            "before it has finished playing is a stall, as long as the listener waited "
            "(cosyvoice_triton/pipeline/playback.py). Stall times in ms.")


def stall_cells(s: dict) -> str:
    """The stall columns of one level (STALL_HEADER), '-' where a figure is missing."""
    def share(key: str) -> str:
        return "-" if s.get(key) is None else f"{100 * s[key]:.0f}%"

    return (f"{share('stall_share')} | {ms(s.get('stall_p50_s'))} / {ms(s.get('stall_p99_s'))} | "
            f"{num(s.get('stalls_mean'), 2)} | {ms(s.get('worst_stall_s'))} | {share('buffered_stall_share')} / "
            f"{ms(s.get('buffered_stall_p99_s'))} |")


def environment_lines(env: dict) -> list[str]:
    lines = []
    for key in ("date", "scenario", "scenario_description", "compare", "target", "voice_mode", "model",
                "server_version", "requests_per_level", "prompt_source", "cpu", "cpu_count", "gpu", "cuda",
                "python", "platform"):
        if env.get(key) not in (None, ""):
            lines.append(f"- **{key}**: {env[key]}")
    versions = env.get("versions", {})  # {package: version}, or a line already written
    if isinstance(versions, dict):
        versions = ", ".join(f"{k} {v}" for k, v in versions.items())
    lines.append(f"- **versions**: {versions}")
    return lines


def markdown(summaries: list[dict], env: dict) -> str:
    lines = [f"# CosyVoice2 benchmark: {env.get('scenario', '')}", ""] + environment_lines(env)
    lines += ["", TIMES_NOTE, "",
              ("| concurrency | requests | errors | first chunk p50 / p90 / p99 | first audible p50 / p90 / p99 "
               "| second chunk p50 / p99 | total p50 / p99 | audio (s) | RTF | throughput |"),
              "|---:|---:|---:|---|---|---|---|---:|---:|---:|"]
    for s in summaries:
        lines.append(
            f"| {s['concurrency']} | {s['requests']} | {s['errors']} | {ms(s['first_chunk_p50_s'])} / "
            f"{ms(s['first_chunk_p90_s'])} / {ms(s['first_chunk_p99_s'])} | {ms(s.get('first_audible_p50_s'))} / "
            f"{ms(s.get('first_audible_p90_s'))} / {ms(s.get('first_audible_p99_s'))} | {ms(s['second_chunk_p50_s'])} / "
            f"{ms(s['second_chunk_p99_s'])} | {ms(s['total_p50_s'])} / {ms(s['total_p99_s'])} | "
            f"{s['audio_s']:.1f} | {num(s['rtf'])} | {num(s['throughput'], 2)} |")
    lines += ["", stalls_note(summaries), "", "| concurrency " + STALL_HEADER, "|---:|---:|---|---:|---:|---|"]
    lines += [f"| {s['concurrency']} | {stall_cells(s)}" for s in summaries]
    errors = [(s["concurrency"], s["first_error"]) for s in summaries if s.get("first_error")]
    if errors:
        lines += ["", "First error per level:", ""] + [f"- concurrency {c}: {e}" for c, e in errors]
    return "\n".join(lines) + "\n"


PLOTS_EXTRA = "pip install 'cosyvoice-triton[bench]'"


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend. Imported here, not at the top: matplotlib is in the
    `bench` extra, not in a server's install, and every module of the wheel must import without it."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"the benchmark plots need matplotlib: {PLOTS_EXTRA}", name="matplotlib") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plots(summaries: list[dict], out: Path, title: str) -> list[Path]:
    plt = pyplot()
    x = [s["concurrency"] for s in summaries]

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [float("nan") if s.get(key) is None else scale * s[key] for s in summaries]

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, series("first_chunk_p50_s", 1000), "o-", label="first chunk p50")
    ax.plot(x, series("first_chunk_p99_s", 1000), "s--", label="first chunk p99")
    ax.plot(x, series("first_audible_p50_s", 1000), "^:", label="first audible p50")
    ax.set(xlabel="concurrency", ylabel="ms from sending", title=f"{title}: first chunk and first audible audio")
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out / "first_chunk.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, series("rtf"), "o-", color="tab:red", label="RTF")
    ax.set(xlabel="concurrency", ylabel="RTF (wall / audio)", title=f"{title}: RTF and throughput")
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(x, series("throughput"), "s--", color="tab:blue", label="throughput")
    twin.set_ylabel("audio seconds per second")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, ["RTF", "throughput"], loc="upper left")
    fig.tight_layout()
    paths.append(out / "rtf_throughput.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    paths.append(stall_plot(plt, x, [("", x, series("stall_share", 100), series("stall_p99_s", 1000))],
                            f"{title}: playback stalls", out / "stalls.png"))
    return paths


def stall_plot(plt, levels: list[int], lines: list[tuple[str, list[int], list[float], list[float]]], title: str,
               path: Path) -> Path:
    """Share of streams with a stall (left) and p99 stall time per stream (right) vs concurrency; one
    (label, concurrencies, shares in %, p99 in ms) per line."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    for label, x, shares, p99 in lines:
        left.plot(x, shares, "o-", label=label or "streams with a stall")
        right.plot(x, p99, "s--", label=label or "p99 stall time")
    left.set(xlabel="concurrency", ylabel="streams with a stall (%)", ylim=(-5, 105))
    right.set(xlabel="concurrency", ylabel="stall time per stream, p99 (ms)")
    for ax in (left, right):
        ax.set_xticks(levels)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_texts(out: Path, markdown_text: str, results: dict) -> dict[str, Path]:
    """report.md and results.json in `out` (made if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "report.md", "json": out / "results.json"}
    paths["markdown"].write_text(markdown_text, encoding="utf-8")
    paths["json"].write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")
    return paths


def write(summaries: list[dict], env: dict, out: Path) -> dict[str, Path]:
    """report.md, results.json and the plots in `out` (made if missing); their paths by name."""
    paths = write_texts(out, markdown(summaries, env), {"environment": env, "levels": summaries})
    first, rtf, stall = plots(summaries, out, env.get("scenario", "benchmark"))
    paths.update(first_chunk_png=first, rtf_png=rtf, stalls_png=stall)
    return paths


# ---- comparisons -----------------------------------------------------------------------------------------

def _variant_line(variant: dict) -> str:
    settings = [f"voice by {variant['voice_mode']}"]
    settings += [f"`{k}={v}`" for k, v in {**variant["options"], **variant["server"]}.items()]
    line = f"- **{variant['name']}**: {variant['description']} ({', '.join(settings)}); {variant['target']}"
    if variant.get("error"):
        line += f"; **did not run**: {variant['error']}"
    return line + "".join(f"\n  - server log: {note}" for note in variant.get("notes", []))


def comparison_markdown(variants: list[dict], env: dict) -> str:
    """Environment, the variants, and one row per concurrency x variant (variants side by side per level)."""
    lines = [f"# CosyVoice2 comparison: {env.get('compare', '')} ({env.get('scenario', '')})", ""]
    lines += environment_lines(env) + ["", "## Variants", ""] + [_variant_line(v) for v in variants]
    lines += ["", "## Results", "", TIMES_NOTE, "",
              ("| variant | concurrency | requests | errors | first chunk p50 / p90 / p99 | first audible p50 "
               "| second chunk p50 | total p50 | RTF | throughput |"),
              "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    rows = sorted(((s["concurrency"], n, v["name"], s) for n, v in enumerate(variants) for s in v["levels"]),
                  key=lambda row: row[:2])
    for _, _, name, s in rows:
        lines.append(
            f"| {name} | {s['concurrency']} | {s['requests']} | {s['errors']} | {ms(s['first_chunk_p50_s'])} / "
            f"{ms(s['first_chunk_p90_s'])} / {ms(s['first_chunk_p99_s'])} | {ms(s.get('first_audible_p50_s'))} | "
            f"{ms(s['second_chunk_p50_s'])} | {ms(s['total_p50_s'])} | {num(s['rtf'])} | {num(s['throughput'], 2)} |")
    summaries = [s for _, _, _, s in rows]
    lines += ["", stalls_note(summaries), "", "| variant | concurrency " + STALL_HEADER,
              "|---|---:|---:|---|---:|---:|---|"]
    lines += [f"| {name} | {s['concurrency']} | {stall_cells(s)}" for _, _, name, s in rows]
    errors = [(name, s["concurrency"], s["first_error"]) for _, _, name, s in rows if s.get("first_error")]
    if errors:
        lines += ["", "First error per variant and level:", ""]
        lines += [f"- {name}, concurrency {c}: {e}" for name, c, e in errors]
    return "\n".join(lines) + "\n"


def _per_variant_plot(variants: list[dict], key: str, scale: float, ylabel: str, title: str, path: Path) -> Path:
    """`key` vs concurrency, one line per variant that ran."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    levels = sorted({s["concurrency"] for v in variants for s in v["levels"]})
    for variant in variants:
        if variant["levels"]:
            x = [s["concurrency"] for s in variant["levels"]]
            y = [float("nan") if s[key] is None else scale * s[key] for s in variant["levels"]]
            ax.plot(x, y, "o-", label=variant["name"])
    ax.set(xlabel="concurrency", ylabel=ylabel, title=title)
    ax.set_xticks(levels)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_comparison(variants: list[dict], env: dict, out: Path) -> dict[str, Path]:
    """report.md, results.json, first_chunk.png, throughput.png and stalls.png of a comparison in `out`."""
    paths = write_texts(out, comparison_markdown(variants, env), {"environment": env, "variants": variants})
    title = f"{env.get('compare', '')} ({env.get('scenario', '')})"
    paths["first_chunk_png"] = _per_variant_plot(variants, "first_chunk_p50_s", 1000, "first chunk p50 (ms)",
                                                 f"{title}: first chunk", out / "first_chunk.png")
    paths["throughput_png"] = _per_variant_plot(variants, "throughput", 1.0, "audio seconds per second",
                                                f"{title}: throughput", out / "throughput.png")
    levels = sorted({s["concurrency"] for v in variants for s in v["levels"]})

    def series(variant: dict, key: str, scale: float) -> list[float]:
        return [float("nan") if s.get(key) is None else scale * s[key] for s in variant["levels"]]

    lines = [(v["name"], [s["concurrency"] for s in v["levels"]], series(v, "stall_share", 100),
              series(v, "stall_p99_s", 1000)) for v in variants if v["levels"]]
    paths["stalls_png"] = stall_plot(pyplot(), levels, lines, f"{title}: playback stalls", out / "stalls.png")
    return paths
