"""A tritonserver on a starved CPU: CPU-bound processes on every core (two per core, each in a session of its
own as other programs are) while the tiny server starts and serves a few streams at once, each with its own
prompt recording (so the prompt steps, the LLM and token2wav all run).

tritonserver 2.51's Python backend gives a stub up when the stub's health thread has not run for about a
second while the server waits on that stub (its `initialize` or an `execute`), and then dies of it
(`boost::interprocess::lock_exception`, SIGSEGV, SIGBUS: docs/operations/faults.md). So, for each run:

- the server starts on its first launch (TritonProcess.start launches once more after a crash at start, which
  would hide one: its log must show one launch);
- every stream completes with audio or is refused with a retry hint, and at least one completes;
- the server still runs afterwards, stops with exit code 0, and its log shows no abort;
- in every stub the model's thread runs below the health thread (triton/stub_priority.py), which keeps the
  server's priority.

Once in the suite; `COSYVOICE_STARVATION_RUNS=10 ./run.sh test tests/test_starvation.py` runs it that many
times, a fresh server each time (the start is when every stub waits on the server at once).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.client import TritonTTS, TTSError
from cosyvoice_triton.random_folder.sample_prompt import speech_like
from cosyvoice_triton.triton.stub_priority import MODEL_NICE_INCREMENT, yield_to_stub_health

from web.stack import triton_server

RUNS = int(os.environ.get("COSYVOICE_STARVATION_RUNS", "1"))
STREAMS = 4  # at once; the test stack's cosyvoice2 runs 4 (tests/web/stack.py)
BUSY_PER_CORE = 2
# What tritonserver writes when python_backend aborts it (a C++ exception out of a lock, or a fatal signal:
# Triton prints "Signal (N) received." for each; 2 is the SIGINT of a normal stop).
ABORT = re.compile(r"lock_exception|terminate called|Signal \((6|7|11)\) received")

pytestmark = pytest.mark.timeout(400 * RUNS)


@contextmanager
def cpu_bound_processes(count: int):
    """`count` busy loops, each in a session of its own; killed (and reaped) when the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
             for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def stub_threads(server) -> dict[str, tuple[int, list[int]]]:
    """model -> (the nice value of the stub's main thread, those of its other threads) for each Python-backend
    stub of `server`."""
    stubs: dict[str, tuple[int, list[int]]] = {}
    prefix = f"{server.model_repository}/"
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().decode(errors="replace")
            if "triton_python_backend_stub" not in command or prefix not in command:
                continue
            model = command.split(prefix, 1)[1].split("/", 1)[0]
            tasks = {task.name: _nice(task) for task in (proc / "task").iterdir()}
            stubs[model] = (tasks.pop(proc.name), sorted(tasks.values()))
        except (OSError, IndexError, KeyError):
            continue  # a process that went away meanwhile
    return stubs


def _nice(task: Path) -> int:
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])  # field 19 of proc(5) `stat`, counted after the command name


def stream_or_refusal(url: str, index: int) -> object:
    """The stream's audio, or the TTSError that refused it."""
    try:
        with TritonTTS(url, timeout_s=240) as tts:
            chunks = list(tts.stream(f"Starved stream number {index}. It asks for a few words.", seed=index,
                                     prompt_audio=speech_like(2.0, 16000, seed=index), prompt_sample_rate=16000,
                                     prompt_text="A prompt."))
        return np.concatenate(chunks)
    except TTSError as exc:
        return exc


def serve_starved(root: Path, model_dir: Path) -> None:
    with cpu_bound_processes(BUSY_PER_CORE * (os.cpu_count() or 1)):
        with triton_server(root, model_dir, shared=False) as (server, _, _):
            own_nice = os.getpriority(os.PRIO_PROCESS, server.pid)
            stubs = stub_threads(server)
            outcomes: list[object] = [None] * STREAMS

            def run(i: int) -> None:
                outcomes[i] = stream_or_refusal(server.grpc_url, i)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            alive = server.is_running()
        exit_code = server.exit_code
        log = server.log_path.read_text(errors="replace")

    aborts = [line for line in log.splitlines() if ABORT.search(line)]
    assert not aborts, f"the server aborted: {aborts}; log {server.log_path}"
    launches = len(re.findall(r"^\$ ", log, re.MULTILINE))  # TritonProcess writes each command line so
    assert launches == 1, f"the server was launched {launches} times (a crash at start); log {server.log_path}"
    assert alive and exit_code == 0, (alive, exit_code, server.log_path)
    kinds = ["audio" if isinstance(o, np.ndarray) and o.size else
             "refused" if isinstance(o, TTSError) and o.retry_after_s is not None else repr(o) for o in outcomes]
    assert set(kinds) <= {"audio", "refused"} and "audio" in kinds, kinds
    assert len(stubs) >= 8, sorted(stubs)  # every Python model of the tiny server
    for model, (main, others) in stubs.items():
        assert main == own_nice + MODEL_NICE_INCREMENT, (model, main, own_nice)
        assert own_nice in others, (model, others)  # the health thread (among others) keeps the server's


def test_a_starved_server_starts_and_serves_without_an_abort(tmp_path, tiny_model_dir):
    for run in range(RUNS):
        serve_starved(tmp_path / f"run{run}", tiny_model_dir)
        if RUNS > 1:
            print(f"starved run {run + 1}/{RUNS}: no abort", flush=True)


def test_outside_a_stub_the_model_priority_call_changes_nothing():
    """Tests and tools import model.py files with a stand-in pb_utils: their thread keeps its priority."""
    before = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux: this thread's
    yield_to_stub_health()
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
