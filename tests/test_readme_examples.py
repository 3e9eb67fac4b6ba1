"""Every example in README.md and the documentation site (docs/, with the files its pages include:
deploy/README.md, perf/README.md), run as a user would run it.

The fenced ```bash and ```python blocks are cut out of the files and run in the order a reader meets them
(README.md, then the site's navigation order, each page followed by the files it includes; an example lives
in one file, however often it is shown), in one working folder, against one service that this module
starts (`cosyvoice-triton up` on the tiny model, free ports). perf/RESULTS.md, which a page also includes,
is a record of measurements: its blocks are the commands that were run on other machines, not examples.
The pages show the default ports (gateway 8080, Triton 8000/8001/8002); the test rewrites them to its
own. Shell blocks run with `bash -euo pipefail` and the virtualenv's bin/ on PATH (as after the
README's `source .venv/bin/activate`), with a `curl` that fails on an HTTP error; Python blocks with the
virtualenv's python. `prompt.wav` and `me.wav`, the user's own recordings in the examples, are made here.

A block that cannot run here has `<!-- example: not-run: WHY -->` just above it. The set of such blocks
must equal NOT_RUN below, so a new unrunnable block fails until someone decides; what can be checked
without running them is checked (bash syntax, every `cosyvoice-triton` / `./run.sh serve` command line
parsed by the real parser, every file they name exists).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
import soundfile as sf

from cli_harness import CliProcess
from conftest import REPO_ROOT
from test_docs_site import site_sources
from triton_harness import tritonserver_or_skip

pytestmark = pytest.mark.timeout(1800)

RECORDS = {"perf/RESULTS.md"}  # measurements, not examples
SOURCES = [file for file in site_sources() if file not in RECORDS]
RUN_LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
NOT_RUN_MARK = re.compile(r"<!--\s*example:\s*not-run:\s*(.+?)\s*-->")

# file -> first line of each block marked not-run
NOT_RUN = {
    "README.md": {
        "./run.sh serve     # set up, then start tritonserver + the gateway on http://localhost:8080 (tiny random "
        "model made on first use)",
    },
    "docs/deployment/index.md": {
        "./run.sh serve                       # = cosyvoice-triton up: tritonserver + gateway on "
        "http://localhost:8080",
        "# a random folder of each family, a server each, one voice store, one gateway in front of both",
    },
    "docs/engines.md": {"cosyvoice-triton serve --engine onnxruntime"},
    "docs/api/official.md": {
        "cosyvoice-triton up --official-triton-port 8003 --official-grpc-port 50000",
        "# gRPC, streamed: one response per audio chunk, then the empty final response",
        "python3 client_grpc.py --server-addr HOST --server-port 8003 --model-name cosyvoice3 --mode streaming \\",
        "mkdir -p build/protos && python -m grpc_tools.protoc -Icosyvoice_triton/gateway=gateway "
        "--python_out=build/protos --grpc_python_out=build/protos gateway/cosyvoice.proto && cp "
        "build/protos/cosyvoice_triton/gateway/cosyvoice_pb2*.py gateway/",
    },
    "docs/fine-tuning.md": {
        "cosyvoice-triton finetune --data my_recordings --model-dir pretrained_models/CosyVoice2-0.5B --out models/mine",
    },
    "docs/benchmarks/index.md": {
        "cosyvoice-triton bench --start --quick                                   # sub-minute smoke run (also in "
        "the tests)",
    },
    "docs/benchmarks/quality.md": {
        "python -m cosyvoice_triton.perf.flow_quality --model-dir FULL_MODEL --speech-tokens 100 --seeds 0 \\",
    },
    "deploy/README.md": {"docker build -t cosyvoice-triton:0.1.0 .", "kubectl create namespace cosyvoice"},
    "perf/README.md": {
        "# against a running server (gRPC, model cosyvoice2)",
        "perf/perf_analyzer_sweep.sh localhost:8001                      # zero-shot inputs, concurrency 1:4:2",
        "bash perf/gpu_bench.sh                               # full-size random folder, fast_clone, levels 1 4 16 64",
    },
}
# what the examples write, checked after each block: audio files must decode
AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".opus", ".ogg"}


@dataclasses.dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence
    language: str
    code: str
    not_run: str | None  # the reason, when marked

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def fenced_blocks(file: str) -> list[Block]:
    lines = (REPO_ROOT / file).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = NOT_RUN_MARK.search(before)
        blocks.append(Block(file, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                            mark.group(1) if mark else None))
        i = end + 1
    return blocks


def examples() -> list[Block]:
    return [b for file in SOURCES for b in fenced_blocks(file) if b.language in RUN_LANGUAGES]


def runnable() -> list[Block]:
    return [b for b in examples() if b.not_run is None]


def test_the_not_run_blocks_are_the_listed_ones():
    marked = {}
    for block in examples():
        if block.not_run is not None:
            marked.setdefault(block.file, set()).add(block.first_line)
    assert marked == NOT_RUN
    assert len(runnable()) >= 15  # the bulk of the examples runs


def test_every_code_block_is_an_example_or_text():
    """An untagged block is text (a tree, a layout); a block tagged with another language is a mistake."""
    for file in SOURCES:
        for block in fenced_blocks(file):
            assert block.language in ("", *RUN_LANGUAGES), f"{block}: unknown block language {block.language!r}"
            if block.language == "":
                assert not re.match(r"\s*(\./|cosyvoice-|curl |docker |kubectl |python |bash )", block.code), \
                    f"{block} looks like commands: tag it ```bash"


def command_lines(code: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    joined = code.replace("\\\n", " ")
    lines = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            lines.append(words)
    return lines


@pytest.mark.parametrize("block", [b for b in examples() if b.not_run], ids=str)
def test_not_run_examples_are_well_formed(block):
    from cosyvoice_triton.cli import build_parser

    check = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
    assert check.returncode == 0, f"{block}: {check.stderr}"
    parser = build_parser()
    for words in command_lines(block.code):
        if words[:2] == ["./run.sh", "serve"]:
            words = ["cosyvoice-triton", "up", *words[2:]]
        if words[0] == "cosyvoice-triton" and not any(w.startswith("/path/") for w in words):
            try:
                parser.parse_args(words[1:])
            except SystemExit:
                pytest.fail(f"{block}: the parser refuses {shlex.join(words)}")
        for flag, value in zip(words, words[1:]):
            if flag == "-f" and words[0] in ("docker", "kubectl"):
                assert (REPO_ROOT / value).exists(), f"{block}: {value} does not exist"
        if words[0] in ("bash", "perf/perf_analyzer_sweep.sh"):
            script = words[1] if words[0] == "bash" else words[0]
            assert (REPO_ROOT / script).exists(), f"{block}: {script} does not exist"


# ---- the runnable examples, against one service ----------------------------------------------------------


@dataclasses.dataclass
class Service:
    gateway: int
    http: int
    grpc: int
    metrics: int
    official_triton: int  # the gateway's Triton gRPC facade (the pages show 8003)
    official_grpc: int  # the official cosyvoice.CosyVoice service (the pages show 50000)
    log: Callable[[], str] = lambda: ""  # the service's output so far

    def rewrite(self, code: str) -> str:
        ports = {"8080": self.gateway, "8000": self.http, "8001": self.grpc, "8002": self.metrics,
                 "8003": self.official_triton, "50000": self.official_grpc}
        return re.sub(r"\b(localhost|127\.0\.0\.1):(8080|8000|8001|8002|8003|50000)\b",
                      lambda m: f"{m.group(1)}:{ports[m.group(2)]}", code)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
            return json.loads(response.read()).get("default_voice") == "ready"
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    from cosyvoice_triton.server import free_port

    tritonserver_or_skip()
    home = tmp_path_factory.mktemp("readme_home")
    ports = Service(*(free_port() for _ in range(6)))
    command = [sys.executable, "-m", "cosyvoice_triton.cli", "up", "--model-dir", str(tiny_model_dir),
               "--host", "127.0.0.1", "--port", str(ports.gateway), "--triton-http-port", str(ports.http),
               "--triton-grpc-port", str(ports.grpc), "--triton-metrics-port", str(ports.metrics),
               "--official-triton-port", str(ports.official_triton), "--official-grpc-port", str(ports.official_grpc),
               "--workers", "4", "--torch-threads", "1", "--max-token-text-ratio", "3",
               # Examples run back to back on a CI machine slower than real time: a request may find the
               # previous example's stream still ending; it waits for it instead of an overload refusal
               # (the refusal has its own tests: test_realtime_admission.py, test_admission*.py).
               "--max-queue-wait", "60"]
    up = CliProcess(command, {**os.environ, "COSYVOICE_HOME": str(home)})
    try:
        deadline = time.monotonic() + 300
        while not _ready(f"http://127.0.0.1:{ports.gateway}"):
            assert up.running(), up.output()
            assert time.monotonic() < deadline, "not ready in time:\n" + up.output()
            time.sleep(0.5)
        yield dataclasses.replace(ports, log=up.output)
    finally:
        up.kill()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, prompt_wav_16k):
    """The user's folder: their recordings, and the checkout's .venv, build/ and perf/ beside them."""
    folder = tmp_path_factory.mktemp("readme_user")
    samples, rate = prompt_wav_16k
    for name in ("prompt.wav", "me.wav"):
        sf.write(folder / name, samples, rate)
    venv = Path(sys.executable).parent.parent
    (folder / ".venv").symlink_to(venv)
    for name in ("build", "perf"):
        (folder / name).symlink_to(REPO_ROOT / name)
    tools = folder / ".test-bin"  # a curl that fails on HTTP errors, as the examples would be read
    tools.mkdir()
    (tools / "curl").write_text('#!/bin/sh\nexec /usr/bin/curl --fail-with-body "$@"\n')
    (tools / "curl").chmod(0o755)
    return folder


def _env(workdir: Path, service: Service) -> dict[str, str]:
    """As after `source .venv/bin/activate`; cosyvoice-client's default gateway (localhost:8080) is ours."""
    venv_bin = Path(sys.executable).parent
    return {**os.environ, "PATH": f"{workdir / '.test-bin'}:{venv_bin}:{os.environ['PATH']}",
            "VIRTUAL_ENV": str(venv_bin.parent), "COSYVOICE_HOME": str(workdir / ".home"),
            "COSYVOICE_URL": service.rewrite("http://localhost:8080")}


def _error_bodies(workdir: Path, code: str) -> str:
    """The short output files a failed example left: curl --fail-with-body writes an error's body there."""
    parts = []
    for name in _outputs(code):
        path = workdir / name
        if path.exists() and path.stat().st_size < 4096:
            parts.append(f"--- {name}\n{path.read_bytes().decode('utf-8', 'replace')}\n")
    return "".join(parts)


def _outputs(code: str) -> list[str]:
    """Files the block writes with curl -o / --out / stream_to_file / write_wav."""
    names = re.findall(r"(?:-o|--out)\s+(\S+)", code)
    names += re.findall(r"""(?:stream_to_file|write_wav)\(\s*["']([^"']+)["']""", code)
    return [n for n in names if not n.startswith("-")]


EXAMPLE_TIMEOUT_S = 300  # the slowest example takes under a minute here


def _run_example(command: list[str], workdir: Path, env: dict[str, str], service: Service):
    """Run one example; one that hangs fails with every Python thread's stack and the service's last log."""
    if command[0] == sys.executable:
        command = [sys.executable, "-X", "faulthandler", *command[1:]]  # SIGABRT dumps every thread's stack
    process = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        stdout, stderr = process.communicate(timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(f"hung for {EXAMPLE_TIMEOUT_S} s:\n{command}\n--- stdout\n{stdout[-3000:]}\n--- stderr (stacks)\n"
                    f"{stderr[-12000:]}\n--- service log\n{service.log()[-6000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.parametrize("block", runnable(), ids=str)
def test_readme_example_runs(block, service, workdir):
    code = service.rewrite(block.code)
    if RUN_LANGUAGES[block.language] == "bash":
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        command = [sys.executable, "-c", code]
    for name in _outputs(code):
        (workdir / name).unlink(missing_ok=True)
    result = _run_example(command, workdir, _env(workdir, service), service)
    assert result.returncode == 0, f"{block} failed ({result.returncode}):\n{code}\n--- stdout\n" \
                                   f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}\n" \
                                   f"{_error_bodies(workdir, code)}--- service log\n{service.log()[-4000:]}"
    for name in _outputs(code):
        path = workdir / name
        assert path.exists() and path.stat().st_size > 0, f"{block} did not write {name}"
        if path.suffix in AUDIO_SUFFIXES:
            import av

            with av.open(str(path)) as container:
                frames = sum(frame.samples for frame in container.decode(audio=0))
            assert frames > 0, f"{block}: {name} holds no audio"
