"""perf/bench_official.py: our side's timing entry (exactly N tokens) and the report from official rounds
recorded by the tool itself (tests/data/official_rounds_tiny.json); perf/exact_length.py: exactly N tokens
on every decoding path (`generate`, the scheduler) and in a server's `llm` model through perf's overlay
(under pb_fake here; on a real tritonserver in tests/test_served_bench_knobs.py), with `serve` itself
carrying no such knob. A tiny CosyVoice3 folder runs through the whole side-by-side harness (the official side
stood in by a second worker of ours), in-process and through a real tritonserver of that folder started as
perf.exact_length starts it, and the official driver's exact length masks all of CosyVoice3's stop ids.

The real side by side needs a checkout of the official repository and a virtualenv with its packages;
making that venv takes longer than a test may, so it is a benchmark (perf/README.md, perf/RESULTS.md),
not a test.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import pb_fake
from cosyvoice_triton.cli import build_parser
from cosyvoice_triton.family import END_OF_PROMPT_ID
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.llm.scheduler import LLMScheduler
from cosyvoice_triton.messages import LLMRequest, SamplingParams
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.perf import bench_official, exact_length as exact_length_module
from cosyvoice_triton.perf.exact_length import PARAMETER, exact_length, exact_length_options
from cosyvoice_triton.random_folder.write import write_random_model
from cosyvoice_triton.server.launcher import DEFAULT_REPOSITORY, ServeOptions, prepare, render_run_repository
from cosyvoice_triton.wire.stage_tensors import llm_inputs
from triton_harness import metric_value, scrape, tritonserver_or_skip

pytestmark = pytest.mark.timeout(600)

DATA = Path(__file__).parent / "data"
N = 30  # speech tokens: more than the first chunk (25 + 3 lookahead with the prompt's padding)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", backbone_weights=False)


def test_our_side_alone_prints_json_of_exactly_n_tokens(model_dir: Path, capsys) -> None:
    """The pipeline with the LLM waiting while token2wav runs and with the two overlapped (the first chunk
    beside the LLM on token2wav's share, and alone on every core; the flow's rows spread over the cores,
    and its batched solver), interleaved."""
    bench_official.main(["--model-dir", str(model_dir), "--speech-tokens", str(N), "--text-tokens", "6",
                         "--prompt-tokens", "20", "--concurrency", "1", "--repeats", "1", "--decode-ahead", "both",
                         "--first-chunk", "both", "--flow-rows", "both", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert (result["speech_tokens"], result["prompt_tokens"]) == (N, 20)
    assert result["text_tokens"] >= 6
    [level] = result["levels"]
    assert level["audio_s"] == pytest.approx(N / 25)  # exactly N tokens, 2 mel frames x 480 samples each
    assert 0 < level["first_audio_s"] <= level["total_s"]
    waits, overlapped = level["variants"]["in_process_llm_waits"], level["variants"]["in_process"]
    assert waits["audio_s"] == overlapped["audio_s"]
    assert level["ratios"]["in_process / in_process_llm_waits"]["total_s"] == pytest.approx(
        overlapped["total_s"] / waits["total_s"])
    shared = level["variants"]["in_process_first_chunk_shared"]
    assert shared["audio_s"] == overlapped["audio_s"]
    assert level["ratios"]["in_process / in_process_first_chunk_shared"]["first_audio_s"] == pytest.approx(
        overlapped["first_audio_s"] / shared["first_audio_s"])
    batched = level["variants"]["in_process_flow_batched"]  # the flow's batched solver: the same audio length
    assert batched["audio_s"] == overlapped["audio_s"] and result["flow_rows"] == "both"
    assert level["ratios"]["in_process / in_process_flow_batched"]["total_s"] == pytest.approx(
        overlapped["total_s"] / batched["total_s"])


def test_bench_official_is_a_cosyvoice_triton_command(model_dir: Path, capsys) -> None:
    from cosyvoice_triton.cli import main

    assert main(["bench-official", "--model-dir", str(model_dir), "--speech-tokens", "4", "--text-tokens", "2",
                 "--prompt-tokens", "20", "--concurrency", "1", "--repeats", "1", "--json"]) == 0
    [level] = json.loads(capsys.readouterr().out)["levels"]
    assert level["audio_s"] == pytest.approx(4 / 25)


def test_report_from_recorded_official_rounds(model_dir: Path, tmp_path: Path) -> None:
    recorded = json.loads((DATA / "official_rounds_tiny.json").read_text())
    meta = recorded["recorded"]
    side = bench_official.OurSide(str(model_dir), meta["speech_tokens"], meta["text_tokens"], meta["prompt_tokens"])
    rounds = {(1, "our"): [side.round(1)], (1, "official"): recorded["rounds"]["c1_official"]}
    assert rounds[(1, "our")][0]["streams"][0]["audio_s"] == rounds[(1, "official")][0]["streams"][0]["audio_s"]
    result = bench_official.write_report(tmp_path, meta, [1], rounds)
    written = json.loads((tmp_path / "side_by_side.json").read_text())
    assert written["levels"] == json.loads(json.dumps(result["levels"]))
    official, ours = result["levels"][0]["official"], result["levels"][0]["ours"]
    table = (tmp_path / "side_by_side.md").read_text()
    ratio = ours["first_audio_s"] / official["first_audio_s"]
    assert f"| 1 | first audio (median) | {official['first_audio_s']:.2f}s | {ours['first_audio_s']:.2f}s | {ratio:.2f} |" in table
    # first audible audio from each side's chunks; these recorded official rounds predate it: '-'
    assert f"| 1 | first audible audio (median) | - | {ours['first_audible_s']:.2f}s | - |" in table
    assert ours["first_audible_s"] >= ours["first_audio_s"]
    assert f"exactly {meta['speech_tokens']} speech tokens" in table


def test_report_puts_the_served_sides_beside_in_process(model_dir: Path, tmp_path: Path) -> None:
    recorded = json.loads((DATA / "official_rounds_tiny.json").read_text())
    official = recorded["rounds"]["c1_official"]
    served = [{**r, "wall_s": 2 * r["wall_s"], "streams": [{**x, "first_s": 2 * x["first_s"]} for x in r["streams"]]}
              for r in official]
    rounds = {(1, "our"): official, (1, "official"): official, (1, "triton"): served, (1, "triton_audio"): official}
    result = bench_official.write_report(tmp_path, recorded["recorded"], [1], rounds)
    level = result["levels"][0]
    assert level["triton"]["first_audio_s"] == pytest.approx(2 * level["official"]["first_audio_s"])
    table = (tmp_path / "side_by_side.md").read_text()
    assert "through tritonserver (voice id) | / official | through tritonserver (prompt as audio)" in table
    first = level["official"]["first_audio_s"]
    assert (f"| 1 | first audio (median) | {first:.2f}s | {first:.2f}s | 1.00 | {2 * first:.2f}s | 2.00 | "
            f"{first:.2f}s | 1.00 |") in table


# ---- exactly N tokens (perf/exact_length.py) ---------------------------------------------------------

REQUEST = LLMRequest(stream_id="exact", text_tokens=[5, 9], prompt_text_tokens=[3, 4],
                     prompt_speech_tokens=[7, 8, 9, 10], sampling=SamplingParams(), seed=5)
LONG = 90  # speech tokens: more than the 2 text tokens' max_len (40) and than the model would stop at


def reference_tokens(llm: SpeechLM, request: LLMRequest = REQUEST) -> list[int]:
    """`generate`'s tokens for `request`, as the scheduler seeds it."""
    ids = [torch.tensor([tokens], dtype=torch.int64)
           for tokens in (request.text_tokens, request.prompt_text_tokens, request.prompt_speech_tokens)]
    return list(generate(llm, *ids, request.sampling, torch.Generator().manual_seed(request.seed)))


def test_an_exact_length_llm_decodes_exactly_n_tokens_on_every_path(model_dir: Path) -> None:
    served = SpeechLM.from_model_dir(model_dir, max_seq_len=512)
    natural = reference_tokens(served)
    assert len(natural) < LONG  # as served: a stop token or max_len ends it sooner

    llm = exact_length(SpeechLM.from_model_dir(model_dir, max_seq_len=512), LONG)
    tokens = reference_tokens(llm)
    assert len(tokens) == LONG
    assert not set(tokens) & set(llm.config.stop_tokens)
    assert reference_tokens(served) == natural  # the class and other instances stay as served

    scheduler = LLMScheduler(llm, max_batch=2, max_seq_len=512)
    scheduler.start()
    try:
        stream = scheduler.submit(REQUEST)
        assert [token for chunk in stream for token in chunk] == tokens
    finally:
        scheduler.stop()
    with pytest.raises(ValueError):
        exact_length(served, 0)


def test_the_server_overlay_serves_the_served_llm_with_exactly_n_tokens(model_dir: Path, tmp_path: Path) -> None:
    options = exact_length_options(ServeOptions(model_dir=model_dir, run_dir=tmp_path / "run", torch_threads=1), N)
    templates = options.repository
    assert templates == tmp_path / "run" / "templates"
    served_file = DEFAULT_REPOSITORY / "llm" / "1" / "model.py"
    assert (templates / "llm" / "1" / "served_model.py").read_text() == served_file.read_text()
    assert (templates / "llm" / "1" / "model.py").read_text() == exact_length_module.OVERLAY.read_text()
    for shipped in (served_file, DEFAULT_REPOSITORY / "llm" / "config.pbtxt"):  # serve itself has no such knob
        assert "exact" not in shipped.read_text()

    repo = render_run_repository(options, model_dir, str(tmp_path / "voices.sqlite"), tmp_path / "run" / "repo")
    config = pb_fake.pbtxt_to_dict((repo / "llm" / "config.pbtxt").read_text())
    assert config["parameters"][PARAMETER]["string_value"] == str(N)
    threads = torch.get_num_threads()
    with pb_fake.installed() as pb:
        model = pb_fake.load_model(repo / "llm" / "1" / "model.py").TritonPythonModel()
        model.initialize(pb_fake.initialize_args(config))
        try:
            request = pb.InferenceRequest(inputs=[pb.Tensor(k, v) for k, v in llm_inputs(REQUEST).items()])
            model.execute([request])
            responses = request.sender.wait_final(120)
        finally:
            model.finalize()
            torch.set_num_threads(threads)
    assert not [r.error() for r in responses if r.has_error()]
    served = [int(t) for r in responses if "speech_tokens" in r.outputs() for t in r.outputs()["speech_tokens"]]
    want = reference_tokens(exact_length(SpeechLM.from_model_dir(model_dir, max_seq_len=4096), N))
    assert len(served) == N
    assert served == want


def test_the_exact_length_server_takes_every_serve_flag_and_serve_takes_none(tmp_path: Path, monkeypatch) -> None:
    started = []
    monkeypatch.setattr(exact_length_module, "serve", lambda options: started.append(options) or 0)
    assert exact_length_module.main(["--exact-speech-tokens", "7", "--model-dir", "DIR", "--run-dir",
                                     str(tmp_path), "--grpc-port", "18001", "--llm-precision", "int8"]) == 0
    [options] = started
    assert (options.model_dir, options.grpc_port, options.llm_precision) == ("DIR", 18001, "int8")
    assert options.repository == tmp_path / "templates"
    assert f'key: "{PARAMETER}" value: {{ string_value: "7" }}' in (tmp_path / "templates/llm/config.pbtxt").read_text()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--exact-speech-tokens", "7"])


def test_a_failed_stream_is_counted_and_the_rounds_are_kept() -> None:
    def fails() -> dict:
        raise ConnectionError("the server went away")

    round_ = bench_official.concurrent_round([lambda: {"first_s": 1.0, "total_s": 2.0, "audio_s": 4.0}, fails])
    assert round_["streams"][1] == {"error": "ConnectionError: the server went away"}
    timed = bench_official.summary([round_])
    assert (timed["failed"], timed["first_audio_s"], timed["total_s"]) == (1, 1.0, 2.0)
    gone = bench_official.summary([bench_official.concurrent_round([fails])])
    assert gone["failed"] == 1 and np.isnan(gone["first_audio_s"])


# ---- a CosyVoice3 folder (the folder's yaml decides the family on both sides) -------------------------

@pytest.fixture(scope="module")
def cv3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("cv3") / "model", size="tiny", backbone_weights=False,
                              family="cosyvoice3")


def official_standin(monkeypatch) -> list[Path]:
    """Stand the official side in by a second worker of ours (same line protocol: the official code cannot
    run here); returns the inputs files our side wrote for it."""
    written = []

    def standin(python: Path, args, inputs: Path) -> list[str]:
        written.append(inputs)
        return bench_official.ours_command(args, inputs.with_name("standin_inputs.npz"))

    monkeypatch.setattr(bench_official, "official_command", standin)
    return written


def test_a_cosyvoice3_folder_runs_side_by_side(cv3_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """The whole harness on a CosyVoice3 folder: two worker processes, interleaved rounds, the report. The
    official code cannot run here, so its side is stood in by a second worker of ours (same line protocol)."""
    written = official_standin(monkeypatch)  # what our side wrote for the official one
    args = argparse_args(["--model-dir", str(cv3_dir), "--official-src", str(tmp_path), "--official-venv",
                          str(tmp_path), "--speech-tokens", str(N), "--text-tokens", "6", "--prompt-tokens", "20",
                          "--concurrency", "1", "--repeats", "2", "--out", str(tmp_path / "out")])
    result = bench_official.side_by_side(args)
    assert result["meta"]["family"] == "cosyvoice3"
    assert result["meta"]["text_tokens"] >= 6
    [level] = result["levels"]
    for side in ("official", "ours"):  # exactly N tokens a stream, both rounds of each side
        assert level[side]["audio_s"] == pytest.approx(N / 25)
        assert (level[side]["rounds"], level[side]["failed"]) == (2, 0)
    assert [name.split("_", 1)[1] for name in result["rounds"]] == ["official", "our"]
    table = (tmp_path / "out" / "side_by_side.md").read_text()
    assert table.startswith("cosyvoice3; ") and f"exactly {N} speech tokens" in table
    # the official CosyVoice3 LM asserts <|endofprompt|> (151646) in prompt_text ++ text
    assert END_OF_PROMPT_ID in np.load(written[0])["prompt_text_tokens"]


def test_a_cosyvoice3_server_is_timed_side_by_side(cv3_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """The served mode on a CosyVoice3 folder: a real tritonserver with perf's exact-length llm (serve renders
    the family's cosyvoice3 and cosyvoice3_offline beside the shared stage models), then the harness with
    --triton: official, in-process, served by voice id and with the prompt as audio, rounds interleaved."""
    run_dir = tmp_path / "run"
    options = exact_length_options(ServeOptions(model_dir=cv3_dir, run_dir=run_dir, address="127.0.0.1",
                                                http_port=None, grpc_port=None, metrics_port=None,
                                                voice_store=str(run_dir / "voices.sqlite"), torch_threads=1,
                                                workers=2), N)
    server = prepare(options, binary=tritonserver_or_skip(), die_with_parent=True)
    official_standin(monkeypatch)
    server.start()
    try:
        args = argparse_args(["--model-dir", str(cv3_dir), "--official-src", str(tmp_path), "--official-venv",
                              str(tmp_path), "--speech-tokens", str(N), "--text-tokens", "6", "--prompt-tokens", "20",
                              "--concurrency", "1", "--repeats", "2", "--threads", "1", "--out", str(tmp_path / "out"),
                              "--triton", server.grpc_url.removeprefix("grpc://")])
        result = bench_official.side_by_side(args)
        metrics = scrape(server.metrics_url)
    finally:
        server.stop()
    models = {path.name for path in (run_dir / "repo").iterdir()}
    assert {"cosyvoice3", "cosyvoice3_offline", "llm", "token2wav", "prompt_encoder"} <= models
    assert not {"cosyvoice2", "cosyvoice2_offline"} & models
    assert f"llm: exactly {N} speech tokens per stream" in server.log_path.read_text(errors="replace")
    # every served stream (2 rounds x voice id and prompt as audio) ended at the exact length, none on a stop id
    assert metric_value(metrics, "cosyvoice_llm_streams_total", reason="max_len") == 4
    assert not metric_value(metrics, "cosyvoice_llm_streams_total", reason="stop_token")
    [level] = result["levels"]
    for side in ("official", "ours", "triton", "triton_audio"):  # exactly N tokens of audio a stream, both rounds
        assert level[side]["audio_s"] == pytest.approx(N / 25), side
        assert (level[side]["rounds"], level[side]["failed"]) == (2, 0), side
        assert 0 < level[side]["first_audio_s"] <= level[side]["total_s"], side
    assert [name.split("_", 1)[1] for name in result["rounds"]] == ["official", "our", "triton", "triton_audio"]
    table = (tmp_path / "out" / "side_by_side.md").read_text()
    assert table.startswith("cosyvoice3; ")
    assert ("| c | | official | ours in-process | / official | through tritonserver (voice id) | / official | "
            "through tritonserver (prompt as audio) | / official |") in table
    first = [line for line in table.splitlines() if line.startswith("| 1 | first audio (median) |")]
    total = [line for line in table.splitlines() if line.startswith("| 1 | total per stream (median) |")]
    assert len(first) == len(total) == 1 and first[0].count("|") == total[0].count("|") == 10
    served = level["triton"]["first_audio_s"]
    assert f"| {served:.2f}s | {served / level['official']['first_audio_s']:.2f} |" in first[0]


def test_our_side_alone_names_the_family(cv3_dir: Path, capsys) -> None:
    bench_official.main(["--model-dir", str(cv3_dir), "--speech-tokens", "4", "--text-tokens", "2",
                         "--prompt-tokens", "20", "--concurrency", "1", "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["family"] == "cosyvoice3"
    assert result["levels"][0]["audio_s"] == pytest.approx(4 / 25)


def test_the_served_side_times_the_served_model_of_the_family(cv3_dir: Path, model_dir: Path,
                                                              monkeypatch) -> None:
    assert bench_official.served_model(str(model_dir)) == "cosyvoice2"
    assert bench_official.served_model(str(cv3_dir)) == "cosyvoice3"
    from cosyvoice_triton.server import launcher

    monkeypatch.setattr(launcher, "DEFAULT_REPOSITORY", cv3_dir / "no_repository")  # a repository without it
    with pytest.raises(SystemExit, match="cosyvoice3 model .*no `cosyvoice3` model"):
        bench_official.main(["--model-dir", str(cv3_dir), "--triton", "localhost:1", "--json"])


def test_the_official_driver_masks_every_stop_token_of_the_lm() -> None:
    """perf/official_driver.py's exact length on an LM with CosyVoice3's 200 stop ids (a stand-in object:
    the official classes live in another virtualenv)."""
    driver = load_driver()
    seen = {}

    class LM:
        stop_token_ids = [6561 + i for i in range(200)]

        def sampling_ids(self, scores, decoded, sampling, ignore_eos=True):
            seen["ignore_eos"] = ignore_eos
            return int(scores.argmax())

        def inference_wrapper(self, lm_input, sampling, min_len, max_len, uuid):
            yield (min_len, max_len)

    lm = LM()
    driver.force_exact_length(lm, 7)
    scores = torch.zeros(6561 + 200)
    scores[6561 + 150] = 1.0  # a stop id would win
    assert lm.sampling_ids(scores, [], 25) < 6561 and seen["ignore_eos"] is False
    assert list(lm.inference_wrapper(None, 25, 2, 40, "u")) == [(7, 7)]
    assert driver.MODEL_CLASSES == {"cosyvoice2.yaml": "CosyVoice2Model", "cosyvoice3.yaml": "CosyVoice3Model"}


def load_driver():
    spec = importlib.util.spec_from_file_location("official_driver", bench_official.DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def argparse_args(argv: list[str]):
    parser = argparse.ArgumentParser()
    bench_official.add_arguments(parser)
    return parser.parse_args(argv)
