"""`cosyvoice-triton bench`: the report pieces, comparison planning, and end to end on a real tritonserver
(tiny random model, free ports): `bench --start --quick` direct over gRPC, `--compare llm_batching` (two
servers in turn, each behind a gateway the bench starts in its own process: `--path http`), and on the
session's shared tiny server `--compare chunk_policy` (direct with `--triton`, and with `--gateway` through a
gateway of this module) and the WebSocket path (`--gateway --path ws`). No timing assertions: only that each
level (of each variant) ran and the report was written."""
from __future__ import annotations

import asyncio
import json
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from cosyvoice_triton.perf import compare, loadgen, report, scenarios, serving

REPO = Path(__file__).resolve().parents[1]


def test_percentile_nearest_rank():
    values = [0.5, 0.1, 0.3, 0.2, 0.4]
    assert loadgen.percentile(values, 50) == 0.3
    assert loadgen.percentile(values, 99) == 0.5
    assert loadgen.percentile([], 50) is None


def test_scenarios_fit_their_description():
    fast = scenarios.build("fast_clone")
    assert all(len(case.text) <= 10 and case.prompt_seconds <= scenarios.MAX_PROMPT_S for case in fast.cases)
    cross = scenarios.build("cross_lingual", quick=True)
    assert all(case.mode == "cross_lingual" for case in cross.cases)
    assert len(scenarios.build("long_text").cases[0].text) > 100


def test_report_from_synthetic_levels(tmp_path):
    levels = [loadgen.LevelResult(c, 1.0, [loadgen.RequestResult(0.1 * c, 0.2 * c, 0.5, 2.0, 3),
                                           loadgen.RequestResult(error="TTSError: busy")]) for c in (1, 2)]
    paths = report.write([level.summary() for level in levels], report.environment(scenario="fast_clone"), tmp_path)
    text = paths["markdown"].read_text()
    assert "| 1 | 2 | 1 | 100 /" in text and "| 2 | 2 | 1 | 200 /" in text and "TTSError: busy" in text
    assert paths["first_chunk_png"].stat().st_size > 0 and paths["rtf_png"].stat().st_size > 0


def test_stall_figures_in_the_report_and_json(tmp_path):
    """Hand-made arrivals: at concurrency 1 no stream stalls; at 2 one of two streams waits 0.3 s at its
    second chunk, which a 0.2 s start buffer shortens to 0.1 s."""
    def streamed(arrivals: list[float]) -> loadgen.RequestResult:
        return loadgen.RequestResult(arrivals[0], arrivals[1], arrivals[-1], 3.0, 3, arrivals=arrivals,
                                     chunk_audio_s=[1.0, 1.0, 1.0])

    levels = [loadgen.LevelResult(1, 3.0, [streamed([0.5, 1.0, 1.5])]),
              loadgen.LevelResult(2, 3.0, [streamed([0.5, 1.0, 1.5]), streamed([0.5, 1.8, 2.0])])]
    summaries = [level.summary() for level in levels]
    assert summaries[0]["stall_share"] == 0.0 and summaries[0]["stall_p99_s"] == 0.0
    assert summaries[1]["stall_share"] == 0.5 and summaries[1]["stall_p99_s"] == pytest.approx(0.3)
    assert summaries[1]["worst_stall_s"] == pytest.approx(0.3) and summaries[1]["stalls_mean"] == 0.5
    assert summaries[1]["buffered_stall_p99_s"] == pytest.approx(0.1) and summaries[1]["start_buffer_s"] == 0.2
    paths = report.write(summaries, report.environment(scenario="fast_clone"), tmp_path)
    text = paths["markdown"].read_text()
    assert "| 1 | 0% | 0 / 0 | 0.00 | 0 | 0% / 0 |" in text
    assert "| 2 | 50% | 0 / 300 | 0.50 | 300 | 50% / 100 |" in text and "200 ms after it" in text
    levels_json = json.loads(paths["json"].read_text())["levels"]
    assert levels_json[1]["stall_share"] == 0.5 and "buffered_stall_share" in levels_json[1]
    assert paths["stalls_png"].stat().st_size > 0
    variants = [{"name": "fixed", "description": "d", "voice_mode": "id", "options": {}, "server": {},
                 "target": "t", "levels": summaries}]
    paths = report.write_comparison(variants, report.environment(compare="chunk_policy"), tmp_path / "cmp")
    assert "| fixed | 2 | 50% | 0 / 300 |" in paths["markdown"].read_text()
    assert paths["stalls_png"].stat().st_size > 0


def test_perf_analyzer_sweep_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "perf" / "perf_analyzer_sweep.sh")], check=True)


def test_bench_start_quick_end_to_end(tiny_model_dir, tmp_path, capsys):
    from triton_harness import tritonserver_or_skip

    from cosyvoice_triton.cli import main

    tritonserver_or_skip()
    out = tmp_path / "report"
    code = main(["bench", "--start", "--quick", "--model-dir", str(tiny_model_dir), "--warmup", "0",
                 "--out", str(out)])
    captured = capsys.readouterr()
    printed = captured.out
    assert code == 0, printed + captured.err  # stderr: the error of a run that stopped (exit 2)
    assert "concurrency   1:" in printed and "concurrency   2:" in printed  # one progress line per level
    assert [row[0] for row in _table_rows(out / "report.md")] == ["1", "2"]
    assert "streams with a stall" in (out / "report.md").read_text()
    results = json.loads((out / "results.json").read_text())
    assert [level["requests"] for level in results["levels"]] == [2, 2]
    assert all(level["errors"] == 0 and level["audio_s"] > 0 for level in results["levels"])
    # every stream that sent audio has its stall figures (0 <= share <= 1)
    assert all(level["streams"] == 2 and 0 <= level["stall_share"] <= 1 and level["stall_p99_s"] >= 0
               for level in results["levels"])
    for name in ("first_chunk.png", "rtf_throughput.png", "stalls.png"):
        assert (out / name).stat().st_size > 0


# ---- comparisons and paths ---------------------------------------------------------------------------------

def _table_rows(report_md: Path) -> list[list[str]]:
    """The cells of the rows of the report's first table whose concurrency cell is a number (the results;
    the stall table follows)."""
    table = "\n".join(report_md.read_text().split("\n\n| ")[1:2])  # the first table, after its blank line
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in ("| " + table).splitlines()
            if line.startswith("| ")]
    return [row for row in rows if len(row) > 1 and row[1].isdigit()]


def test_variant_planning_gives_each_server_its_options(tmp_path):
    settings = serving.Settings(path="grpc", start=True, device="cuda", torch_threads=1, quick=True)
    engines = compare.plan("engine", device="cuda")
    assert [v.name for v in engines] == ["torch", "onnxruntime", "tensorrt"]
    assert [v.name for v in compare.plan("engine", device="cpu")] == ["torch", "onnxruntime"]
    groups = compare.server_groups(engines)
    assert len(groups) == 3  # one server per engine, started in turn
    options = [serving.serve_options(settings, tmp_path / str(n), server) for n, (server, _) in enumerate(groups)]
    assert [o.engine for o in options] == ["torch", "onnxruntime", "tensorrt"]
    assert all(o.device == "cuda" and o.onnx_dir is None and o.max_token_text_ratio == serving.QUICK_RATIO
               for o in options)  # onnx_dir None: the launcher picks <run dir>/onnx for a read-only model folder
    batching = compare.plan("llm_batching")
    assert [serving.serve_options(settings, tmp_path, s).llm_max_batch
            for s, _ in compare.server_groups(batching)] == [8, 1]
    for axis in ("voice_cache", "chunk_policy"):  # request-side axes share one server
        assert len(compare.server_groups(compare.plan(axis))) == 1
    assert [v.voice_mode for v in compare.plan("voice_cache")] == ["id", "audio"]
    assert compare.plan("chunk_policy")[0].options == {}  # the server's own policy first
    assert compare.unsupported("engine", serving.Settings(path="grpc", start=False, url="h:1"))
    for path in ("http", "ws"):  # request-side axes run on every path
        assert compare.unsupported("chunk_policy", serving.Settings(path=path, start=True)) is None
        assert compare.unsupported("voice_cache", serving.Settings(path=path, start=False, url="http://h")) is None


def test_gateway_targets_send_the_variants_options():
    """The chunk-policy overrides of a variant go with every gateway request (as /v1/tts fields or in the
    WebSocket start message, through the SDK's keyword options)."""
    calls = []

    class Client:
        async def stream(self, text, **options):
            calls.append(("http", options))

        async def stream_ws(self, text, **options):
            calls.append(("ws", options))

    case = scenarios.build("fast_clone", quick=True).cases[0]
    overrides = dict(compare.CHUNK_POLICIES[2][2])  # fixed-50: all three fields
    for path in ("http", "ws"):
        target = loadgen.make_target(path, "http://127.0.0.1:1")
        target.client = Client()
        asyncio.run(target.stream(case, "v_1", 5, overrides))
    want = {"mode": case.mode, "seed": 5, "voice_id": "v_1", **overrides}
    assert calls == [("http", want), ("ws", want)]


def test_bad_target_and_path_combinations_exit_2(capsys):
    from cosyvoice_triton.cli import main

    assert main(["bench", "--triton", "localhost:1", "--path", "ws"]) == 2
    assert main(["bench", "--gateway", "http://localhost:1", "--path", "grpc"]) == 2
    assert main(["bench", "--triton", "localhost:1", "--compare", "llm_batching"]) == 2
    assert main(["bench", "--compare", "engine"]) == 2  # no target
    assert capsys.readouterr().err.count("error:") == 4


def test_comparison_report_from_synthetic_levels(tmp_path):
    level = loadgen.LevelResult(1, 1.0, [loadgen.RequestResult(0.1, None, 0.5, 2.0, 1)]).summary()
    common = {"voice_mode": "id", "server": {}, "target": "triton grpc h:1", "notes": []}
    variants = [{**common, "name": "a", "description": "first", "options": {}, "error": None,
                 "levels": [level, {**level, "concurrency": 2}]},
                {**common, "name": "b", "description": "second", "options": {"chunk_first_hop": 10},
                 "error": "TritonStartError: no", "levels": []}]  # its server did not start
    paths = report.write_comparison(variants, report.environment(scenario="fast_clone", compare="chunk_policy"),
                                    tmp_path)
    text = paths["markdown"].read_text()
    assert [row[:4] for row in _table_rows(paths["markdown"])] == [["a", "1", "1", "0"], ["a", "2", "1", "0"]]
    assert "`chunk_first_hop=10`" in text and "did not run**: TritonStartError: no" in text
    assert json.loads(paths["json"].read_text())["variants"][1]["error"] == "TritonStartError: no"
    assert paths["first_chunk_png"].stat().st_size > 0 and paths["throughput_png"].stat().st_size > 0


@pytest.fixture(scope="module")
def shared_server(tiny_model_dir, tmp_path_factory):
    """The session's shared tritonserver on the tiny folder (tests/web/stack.py): (server, model_dir,
    voice_store), for the runs that need no server of their own."""
    from web.stack import triton_server

    with triton_server(tmp_path_factory.mktemp("bench_stack"), tiny_model_dir) as served:
        yield served


@pytest.fixture(scope="module")
def shared_gateway(shared_server, tmp_path_factory) -> str:
    """A gateway served from this process in front of the shared server; its URL."""
    from web.stack import gateway

    server, model_dir, voice_store = shared_server
    with gateway(server, tmp_path_factory.mktemp("bench_gateway"), model_dir, voice_store) as url:
        yield url


def _run_compare(target: list[str], out: Path, capsys, *extra: str, levels: tuple[int, ...] = (1, 2)) -> dict:
    """`bench TARGET --quick --compare ...` at `levels` into `out`; its results.json, after checking that
    every variant ran every level with audio and no errors, and that the report and plots are there."""
    from triton_harness import tritonserver_or_skip

    from cosyvoice_triton.cli import main

    tritonserver_or_skip()
    code = main(["bench", *target, "--quick", "--warmup", "0",
                 "--concurrency", *map(str, levels), "--out", str(out), *extra])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err[-3000:]
    results = json.loads((out / "results.json").read_text())
    names = [variant["name"] for variant in results["variants"]]
    rows = _table_rows(out / "report.md")
    assert sorted((row[0], row[1]) for row in rows) == sorted((name, str(c)) for name in names for c in levels)
    assert all(row[3] == "0" for row in rows)  # no errors in any variant x level
    for variant in results["variants"]:
        assert variant["error"] is None
        assert [level["concurrency"] for level in variant["levels"]] == list(levels)
        assert all(level["errors"] == 0 and level["requests"] == 2 and level["audio_s"] > 0
                   for level in variant["levels"])
    for name in ("first_chunk.png", "throughput.png"):
        assert (out / name).stat().st_size > 0
    return results


@pytest.mark.parametrize("path", ["grpc", "http"])
def test_compare_chunk_policy_on_one_server(shared_server, shared_gateway, tmp_path, capsys, path):
    """Direct (`--triton`, the shared server), and through a gateway in front of it (`--gateway`; the gateway
    would answer 400, counted as errors, to any override it did not take)."""
    target = ["--triton", shared_server[0].grpc_url] if path == "grpc" else ["--gateway", shared_gateway]
    results = _run_compare(target, tmp_path / "report", capsys, "--path", path, "--compare", "chunk_policy")
    assert [v["name"] for v in results["variants"]] == ["default", "small-first", "fixed-50"]
    assert results["variants"][1]["options"] == {"chunk_first_hop": 10}
    assert len({v["target"] for v in results["variants"]}) == 1  # one server for all three
    assert results["environment"]["target"].startswith(f"{path} path")


def test_compare_llm_batching_starts_a_server_per_variant(tiny_model_dir, tmp_path, capsys):
    """Each variant's server, started by the bench, behind a gateway the bench starts in its own process in
    front of it (`--start --path http`: the only run through that gateway)."""
    # one level: most of this test is starting two servers, one after the other
    results = _run_compare(["--start", "--model-dir", str(tiny_model_dir)], tmp_path / "report", capsys,
                           "--path", "http", "--compare", "llm_batching", levels=(2,))
    assert [v["server"] for v in results["variants"]] == [{"llm_max_batch": 8}, {"llm_max_batch": 1}]
    assert len({v["target"] for v in results["variants"]}) == 2  # two servers (and gateways), one after the other
    assert all(v["target"].startswith("gateway http http://127.0.0.1:") for v in results["variants"])
    assert results["environment"]["target"].startswith("http path")


def test_websocket_path_through_a_gateway(shared_gateway, tmp_path, capsys):
    """`--gateway URL --path ws`: every request is a WS /v1/tts/ws session on the gateway; with the voice
    cache comparison, once by voice id and once with the prompt audio in the start message."""
    results = _run_compare(["--gateway", shared_gateway], tmp_path / "report", capsys, "--path", "ws",
                           "--compare", "voice_cache", levels=(2,))
    assert [v["voice_mode"] for v in results["variants"]] == ["id", "audio"]
    assert all(v["target"].startswith("gateway ws http://127.0.0.1:") for v in results["variants"])
    assert results["environment"]["target"].startswith("ws path")


def test_engine_fallbacks_are_read_from_the_server_log(tmp_path):
    log = tmp_path / "tritonserver.log"
    fallback = "token2wav: engine 'tensorrt' is not available on cpu (no tensorrt); using 'onnxruntime'"
    log.write_text(f'W1130 02:19:29.72 1 logs.py:38] "{fallback}"\nW1130 02:19:30.01 2 logs.py:38] "{fallback}"\n'
                   "I1130 02:19:31.00 1 server.cc:1] model ready\n")
    assert serving.engine_warnings(log) == [fallback]
    assert serving.engine_warnings(None) == []


def test_a_server_that_does_not_start_fails_its_variants_only(monkeypatch, tmp_path):
    from cosyvoice_triton.errors import CosyVoiceError
    @contextmanager
    def deployment(settings, run_dir, server):
        if server["engine"] == "torch":
            raise CosyVoiceError("tritonserver exited\nlog tail ...")
        yield serving.Endpoint("grpc", "127.0.0.1:1")

    measured = loadgen.LevelResult(1, 1.0, [loadgen.RequestResult(0.1, None, 0.5, 2.0, 1)])
    monkeypatch.setattr(serving, "deployment", deployment)
    monkeypatch.setattr(loadgen, "measure", lambda *args, **kwargs: [measured])
    load = compare.Load(scenarios.build("fast_clone", quick=True), [1], 1, 0)
    settings = serving.Settings(path="grpc", start=True)
    results = compare.run_variants(settings, compare.plan("engine"), load, tmp_path)
    assert [(r.variant.name, r.error) for r in results] == [
        ("torch", "CosyVoiceError: tritonserver exited"), ("onnxruntime", None)]
    assert results[1].levels == [measured.summary()]


def test_adaptive_chunks_are_interleaved_round_by_round(monkeypatch, tmp_path):
    """`--compare adaptive_chunks`: one server; at each level, rounds of `concurrency` requests of fixed then
    adaptive (per-request chunk_policy) with the same seeds, the warm-up only before each variant's first round, the
    start buffer passed on; each variant's rounds make one level."""
    @contextmanager
    def deployment(settings, run_dir, server):
        assert server == {}  # one server for both variants
        yield serving.Endpoint("grpc", "127.0.0.1:1")

    calls = []

    def measure(make, cases, concurrency, requests, **kwargs):
        calls.append((kwargs["options"]["chunk_policy"], concurrency, requests, kwargs["warmup"],
                      kwargs["start_buffer_s"], kwargs["seed"]))
        return [loadgen.LevelResult(concurrency[0], 1.0, [loadgen.RequestResult(0.1, None, 0.5, 2.0, 1)] * requests)]

    monkeypatch.setattr(serving, "deployment", deployment)
    monkeypatch.setattr(loadgen, "measure", measure)
    load = compare.Load(scenarios.build("fast_clone", quick=True), [1, 4], 2, 1, start_buffer_s=0.3)
    results = compare.run_variants(serving.Settings(path="grpc", start=True), compare.plan("adaptive_chunks"),
                                   load, tmp_path, interleave=True)
    assert calls == [("fixed", [1], 1, 1, 0.3, 100_000), ("adaptive", [1], 1, 1, 0.3, 100_000),
                     ("fixed", [1], 1, 0, 0.3, 100_001), ("adaptive", [1], 1, 0, 0.3, 100_001),
                     ("fixed", [4], 2, 0, 0.3, 200_000), ("adaptive", [4], 2, 0, 0.3, 200_000)]
    assert [[(level["concurrency"], level["requests"], level["wall_s"]) for level in r.levels] for r in results] \
        == [[(1, 2, 2.0), (4, 2, 1.0)]] * 2
    assert "adaptive_chunks" in compare.INTERLEAVED_AXES


def test_token_text_ratio_reaches_the_started_server(tmp_path):
    from cosyvoice_triton.perf import bench

    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--start", "--token-text-ratio", "6"])
    settings = bench.settings_from_args(args, [1])
    assert serving.serve_options(settings, tmp_path).max_token_text_ratio == 6.0
    quick = bench.settings_from_args(parser.parse_args(["--start", "--quick"]), [1])
    assert serving.serve_options(quick, tmp_path).max_token_text_ratio == serving.QUICK_RATIO


def test_request_timeout_reaches_every_target_and_the_started_gateway(tmp_path):
    """`--request-timeout-s`: the client's deadline of each request on every path, and the gateway started
    for http/ws waits as long for the server's chunks (a full-size folder at c = 8 needs more than 600 s)."""
    from cosyvoice_triton.perf import bench

    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    settings = bench.settings_from_args(parser.parse_args(["--start", "--request-timeout-s", "3600"]), [1])
    assert settings.request_timeout_s == 3600.0
    for path in loadgen.PATHS:
        endpoint = serving.Endpoint(path, "127.0.0.1:1" if path == "grpc" else "http://127.0.0.1:1",
                                    request_timeout_s=settings.request_timeout_s)
        assert endpoint.target().client.timeout_s == 3600.0
    default = bench.settings_from_args(parser.parse_args(["--start"]), [1])
    assert serving.Endpoint("grpc", "127.0.0.1:1").target().client.timeout_s == default.request_timeout_s == 600.0

    class Server:
        grpc_url, metrics_url = "127.0.0.1:1", "http://127.0.0.1:2/metrics"

    options = serving.serve_options(settings, tmp_path)
    routing = serving.gateway_config(Server, options, 8, settings.request_timeout_s).routing
    assert routing.first_chunk_timeout_s == routing.chunk_timeout_s == 3600.0
