"""The servers we start die with their parent, and starting them never forks this process.

`term_with_parent` (cosyvoice_triton/server/process.py) wraps a command so that the child asks the
kernel for SIGTERM when its parent dies, then becomes the command. It replaced a `preexec_fn`, which
made subprocess fork() this multithreaded, gRPC-using process and run every atfork handler in it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from cosyvoice_triton.server.process import term_with_parent


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_child_gets_sigterm_when_its_parent_is_killed(tmp_path: Path):
    marker = tmp_path / "terminated"
    child = (f"import signal, sys, time, pathlib; "
             f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(marker)!r}).write_text('TERM'), sys.exit(0))); "
             f"print('ready', flush=True); time.sleep(600)")
    parent = textwrap.dedent(f"""
        import subprocess, sys
        from cosyvoice_triton.server.process import term_with_parent
        child = subprocess.Popen(term_with_parent([sys.executable, "-c", {child!r}]), stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        print(child.pid, flush=True)
        import time; time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(process.stdout.readline())
        with open(f"/proc/{child_pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[:2] == [sys.executable.encode(), b"-c"]  # the command itself, exec'd
        process.kill()  # SIGKILL: no atexit hook, no cleanup, only the kernel's signal
        process.wait()
        assert _gone(child_pid, 10), "the child outlived its parent"
        assert marker.read_text() == "TERM"
    finally:
        process.kill()


def test_a_child_whose_parent_died_before_it_asked_exits():
    """The parent's pid travels with the command: a child orphaned before prctl ran does not start."""
    command = term_with_parent([sys.executable, "-c", "print('started')"])
    command[command.index(str(os.getpid()))] = "1"  # as if the parent had gone and init adopted the child
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "started" not in done.stdout


def test_starting_a_server_runs_no_fork_handler_in_this_process(tmp_path: Path):
    from redis_harness import redis_binary_or_skip
    from cosyvoice_triton.server.redis_process import start_redis

    forks = []
    os.register_at_fork(before=lambda: forks.append(os.getpid()))
    server = start_redis(redis_binary_or_skip(), tmp_path)
    try:
        assert server.is_running()
    finally:
        server.stop()
    assert forks == []  # vfork/posix_spawn: no atfork handler (gRPC's, torch's) ran in the parent
    assert server.exit_code == 0  # still a clean SIGTERM stop through the wrapper
