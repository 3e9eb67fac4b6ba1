"""The report of `gpu_bench.py`: report.md (environment, settings, one table per scenario, the targets, then
each family's stage sections from gpu_stages.py), results.json and one PNG per scenario, on perf/report.py's
helpers (number formats, environment, pyplot, file writing)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from cosyvoice_triton.perf import report
from cosyvoice_triton.perf.report import ms, num

TARGETS = (  # (scenario or None for every scenario, concurrency, summary key, bound, label); reported only
    ("fast_clone", 1, "first_chunk_p50_s", 0.050, "first chunk p50 <= 50 ms"),
    ("fast_clone", 16, "first_chunk_p99_s", 0.250, "first chunk p99 <= 250 ms"),
    (None, 64, "rtf", 0.01, "aggregate RTF <= 0.01"),
)


def target_rows(results: dict) -> list[dict]:
    """Each target against the levels that ran: met / not met / not measured."""
    rows = []
    for scenario_name, concurrency, key, bound, label in TARGETS:
        for scenario in results["scenarios"]:
            if scenario_name not in (None, scenario["name"]):
                continue
            level = next((s for s in scenario["levels"] if s["concurrency"] == concurrency), None)
            value = None if level is None else level[key]
            status = "not measured" if value is None else ("met" if value <= bound else "not met")
            shown = "-" if value is None else (f"{value:.4f}" if key == "rtf" else f"{ms(value)} ms")
            rows.append({"target": f"{title(scenario)}: {label} at concurrency {concurrency}",
                         "measured": shown, "status": status})
    return rows


def title(scenario: dict) -> str:
    """The scenario's name, with the variant it ran under (CUDA graphs, LLM precision) when there is one."""
    return f"{scenario['name']} ({scenario['variant']})" if scenario.get("variant") else scenario["name"]


def plot_name(scenario: dict) -> str:
    return f"{scenario['name']}-{scenario['slug']}.png" if scenario.get("slug") else f"{scenario['name']}.png"


MEASURES_NOTE = (
    "The serving engines and the pipeline in one process, no Triton transport (gRPC, BLS and copies "
    "between models are excluded). Times in ms from handing the request to the pipeline; RTF = level "
    "wall time / audio seconds made; throughput = audio seconds per second; flow batch = mean chunks per "
    "token2wav flow call.")
TABLE_HEADER = ("| concurrency | requests | errors | first chunk p50 / p90 / p99 | first audible p50 | second chunk p50 "
                "| total p50 | audio / request (s) | RTF | throughput | flow batch |")
RANDOM_LLM_NOTE = ("random weights: the LLM seldom samples its end token, so each sentence runs to the most "
                   "speech tokens per text token allowed; audio lengths are not those of real speech")


def table_row(s: dict) -> str:
    cut = "" if s["requests"] == s["planned"] else f" of {s['planned']}"
    return (f"| {s['concurrency']} | {s['requests']}{cut} | {s['errors']} | {ms(s['first_chunk_p50_s'])} / "
            f"{ms(s['first_chunk_p90_s'])} / {ms(s['first_chunk_p99_s'])} | {ms(s.get('first_audible_p50_s'))} | "
            f"{ms(s['second_chunk_p50_s'])} | "
            f"{ms(s['total_p50_s'])} | {num(s['audio_per_request_s'], 2)} | {num(s['rtf'], 4)} | "
            f"{num(s['throughput'], 1)} | {num(s['flow_batch_mean'], 1)} |")


def markdown(results: dict) -> str:
    lines = ["# GPU benchmark: in-process serving path", "",
             *report.environment_lines(results["environment"]),
             *(f"- **{key}**: {value}" for key, value in results["settings"].items()),
             *(f"- **note**: {note}" for note in results["notes"]), "", MEASURES_NOTE]
    for scenario in results["scenarios"]:
        lines += ["", f"## {title(scenario)}", "", f"{scenario['description']}; prompt {scenario['prompt']}", ""]
        if scenario["levels"]:
            lines += [TABLE_HEADER, "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
            lines += [table_row(s) for s in scenario["levels"]] + [""]  # a blank line ends the table
        if scenario.get("warmup"):
            lines.append(f"- warm-up, not in the table: {progress_line('', scenario['warmup']).strip()}")
        lines += [f"- {line}" for line in scenario["skipped"]]
        lines += [f"- first error at concurrency {s['concurrency']}: {s['first_error']}"
                  for s in scenario["levels"] if s["first_error"]]
    lines += ["", "## Targets (reported, not asserted)", "", "| target | measured | status |", "|---|---:|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {t['status']} |" for t in target_rows(results)]
    for stage in results.get("stages", []):
        lines += ["", f"## {stage['title']}", "", stage["markdown"].rstrip()]
    return "\n".join(lines) + "\n"


def plot(scenario: dict, path: Path) -> None:
    """First chunk p50/p90/p99 (left) and RTF with throughput (right) against concurrency."""
    plt = report.pyplot()
    levels = scenario["levels"]
    x = [s["concurrency"] for s in levels]

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [float("nan") if s[key] is None else scale * s[key] for s in levels]

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for q, style in (("p50", "o-"), ("p90", "^:"), ("p99", "s--")):
        left.plot(x, series(f"first_chunk_{q}_s", 1000), style, label=q)
    left.set(xlabel="concurrency", ylabel="first chunk (ms)", title=f"{title(scenario)}: first chunk")
    right.plot(x, series("rtf"), "o-", color="tab:red", label="RTF")
    right.set(xlabel="concurrency", ylabel="RTF (wall / audio)", title=f"{title(scenario)}: RTF, throughput")
    twin = right.twinx()
    twin.plot(x, series("throughput"), "s--", color="tab:blue", label="throughput")
    twin.set_ylabel("audio seconds per second")
    for ax in (left, right):
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
    left.legend()
    right.legend(right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0],
                 ["RTF", "throughput"], loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(results: dict, out: Path, plots: bool) -> str:
    """report.md and results.json (and, when `plots`, one PNG per scenario) in `out`; the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    if plots and importlib.util.find_spec("matplotlib") is None:
        results["notes"].append("matplotlib is not installed: no plots")
        plots = False
    for scenario in results["scenarios"] if plots else []:
        if scenario["levels"]:
            plot(scenario, out / plot_name(scenario))
    results["targets"] = target_rows(results)
    text = markdown(results)
    report.write_texts(out, text, results)
    return text


def environment(device: torch.device) -> dict:
    """perf/report.py's environment, with the GPU named from the device this run used."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        gpu = f"no GPU used (device {device})"
    cuda = f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}" if torch.version.cuda else None
    return report.environment(gpu=gpu, cuda=cuda)


def progress_line(name: str, s: dict) -> str:
    return (f"{name} concurrency {s['concurrency']:3d}: {s['requests']} requests, {s['errors']} errors, first "
            f"chunk p50 {ms(s['first_chunk_p50_s'])} ms p99 {ms(s['first_chunk_p99_s'])} ms, RTF "
            f"{num(s['rtf'], 4)}, {num(s['throughput'], 1)} audio s/s, {s['wall_s']:.1f} s")
