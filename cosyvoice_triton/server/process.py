"""Run a `tritonserver` process whose Python-backend models import from a chosen Python environment
(`python_env.py` says how the stubs are made to run it).

What the server process needs (found by running the pytriton 0.7.0 binary, Triton 2.51, and reading
python_backend's stub launcher):

* **Shared memory.** Every model instance gets its own region in `/dev/shm`, created at
  `shm-default-byte-size` and grown by `shm-growth-byte-size` when a message does not fit. Defaults
  here: 16 MiB and 16 MiB (Triton's are 1 MiB/1 MiB; pytriton uses 4 MiB/1 MiB), so that waveform and
  mel tensors of a few MB rarely need growth. "shm full" / "Failed to increase the shared memory pool
  size" errors mean `/dev/shm` itself is too small: Docker gives 64 MiB unless run with
  `--shm-size=1g` (or `--ipc=host`); Kubernetes needs an `emptyDir: {medium: Memory}` on `/dev/shm`.
* **Region names.** Regions are named `<shm-region-prefix-name><n>`; two servers on one host with
  the same prefix clash, so every `TritonProcess` uses a fresh prefix, and removes its leftover
  `/dev/shm/<prefix>*` files after the server has gone.
* **Stub health.** The backend gives a stub up when the stub's health thread has not run for about a
  second while the server waits on that stub, and the server then dies (docs/operations/faults.md); the
  models therefore run below that thread (triton/stub_priority.py). Its `stub-timeout-seconds` is read and
  never used (2.51 up to the newest python_backend), so it is not offered here.
* **Auto-complete.** With auto-complete on, Triton starts one extra stub per Python model only to
  call `auto_complete_config` (importing torch once more). Our configs are complete, so it is off by
  default (`--disable-auto-complete-config`).
* **Logs.** The stubs' stdout and stderr (prints, tracebacks) go to tritonserver's, so the process's
  stdout and stderr both go to the log file, rather than using `--log-file`.
* **Readiness.** `/v2/health/ready` answers 200 once every model is loaded (strict readiness). The
  HTTP and gRPC endpoints only start after the models load, so a busy port shows up late, as
  "already in use" in the log; ports that we picked are then picked again.
* **Stopping.** SIGINT starts a graceful shutdown bounded by `--exit-timeout-secs`; after `grace_s`
  the process group (started as a new session, so it holds only the server and its stubs) gets SIGKILL.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from cosyvoice_triton.errors import TritonStartError
from cosyvoice_triton.server.binary import TritonBinary, find_tritonserver, stage_backend_directory
from cosyvoice_triton.server.ports import check_ports_free
from cosyvoice_triton.server.python_env import PythonEnv, server_environment
from cosyvoice_triton.targets import TritonTarget

log = logging.getLogger(__name__)

MiB = 1024 * 1024
DEFAULT_SHM_DEFAULT_BYTES = 16 * MiB
DEFAULT_SHM_GROWTH_BYTES = 16 * MiB
# Triton's bound on a graceful stop. Its default (10 s) is too short for a dozen Python-backend stubs to
# unload on 2 busy cores: the server then exits 1 although every model would have stopped cleanly.
EXIT_TIMEOUT_S = 30
GROUP_GONE_TIMEOUT_S = 10.0  # before a restart: the killed server's stubs have exited

CONTROL_MODES = ("none", "explicit", "poll")
_PORT_CLASH = "already in use"


_LOADED = re.compile(r"successfully loaded '([^']+)'")


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port that is free on `address` right now (the OS picks it; another process may still
    take it before the server binds, which `TritonProcess` handles by retrying)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _free_ports(address: str, count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(address)
        if port not in ports:
            ports.append(port)
    return ports


def describe_exit(code: int | None) -> str:
    """A process's exit code in words: "exit code 1", "killed by SIGKILL" (a negative code)."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_LIVE: "weakref.WeakSet[TritonProcess]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop()


class TritonProcess:
    """A tritonserver process serving `model_repository`.

    ```
    with TritonProcess("runs/repo", grpc_port=None) as server:   # free ports picked when None
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    ```
    `start()` returns once `/v2/health/ready` answers 200 and raises `TritonStartError` (with the log's
    tail) if the process exits or the deadline passes first. `stop()` is idempotent; servers still
    running when the interpreter exits are stopped by an atexit hook, and with `die_with_parent` the
    kernel stops the server even if this process is killed outright (tests use it).

    GPU models that keep tensors on the GPU may want `extra_args` such as
    `--cuda-memory-pool-byte-size=0:268435456`; every other server flag can go there too.
    """

    def __init__(self, model_repository: str | Path, *, workdir: str | Path | None = None,
                 address: str = "127.0.0.1", http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, model_control_mode: str = "none",
                 load_models: Sequence[str] = (), python_env: PythonEnv | str | Path | None = None,
                 binary: TritonBinary | None = None, pythonpath: Sequence[str | Path] = (),
                 env: Mapping[str, str] | None = None,
                 shm_default_byte_size: int = DEFAULT_SHM_DEFAULT_BYTES,
                 shm_growth_byte_size: int = DEFAULT_SHM_GROWTH_BYTES,
                 auto_complete_config: bool = False,
                 log_verbose: int = 0, exit_timeout_s: int = EXIT_TIMEOUT_S, startup_timeout_s: float = 180.0,
                 die_with_parent: bool = False, extra_args: Sequence[str] = ()):
        if model_control_mode not in CONTROL_MODES:
            raise ValueError(f"model_control_mode must be one of {CONTROL_MODES}, got {model_control_mode!r}")
        if load_models and model_control_mode != "explicit":
            raise ValueError("load_models needs model_control_mode='explicit'")
        if shm_default_byte_size < 4 * MiB:
            raise ValueError("shm_default_byte_size must be at least 4 MiB (the Python backend's minimum)")
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise FileNotFoundError(f"model repository {self.model_repository} does not exist")
        self.address = address
        self._requested_ports = (http_port, grpc_port, metrics_port)
        self.http_port, self.grpc_port, self.metrics_port = self._requested_ports
        self.model_control_mode = model_control_mode
        self.load_models = tuple(load_models)
        if python_env is None:
            python_env = PythonEnv.current()
        elif not isinstance(python_env, PythonEnv):
            python_env = PythonEnv.from_prefix(python_env)
        self.python_env = python_env
        self.binary = binary or find_tritonserver()
        self.pythonpath = tuple(pythonpath)
        self.extra_env = dict(env or {})
        self.shm_default_byte_size = shm_default_byte_size
        self.shm_growth_byte_size = shm_growth_byte_size
        self.auto_complete_config = auto_complete_config
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.die_with_parent = die_with_parent
        self.extra_args = tuple(extra_args)
        self.shm_region_prefix = f"cvt{os.getpid()}_{secrets.token_hex(4)}_"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else None
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self._log_offset = 0
        self._keep_workdir = False
        self.returncode: int | None = None

    # -- addresses ---------------------------------------------------------------------------------
    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address

    @property
    def http_url(self) -> str:
        """`host:port`, as `tritonclient.http.InferenceServerClient(url=...)` wants it."""
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def target(self) -> TritonTarget:
        """This server as gateways and split frontends address it."""
        return TritonTarget(grpc=self.grpc_url, metrics_url=self.metrics_url)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None, "not started"
        return self.workdir / "tritonserver.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- command -----------------------------------------------------------------------------------
    def command(self, backend_dir: Path) -> list[str]:
        args = [
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--http-address={self.address}", f"--http-port={self.http_port}",
            f"--grpc-address={self.address}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.address}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            f"--model-control-mode={self.model_control_mode}",
            *(f"--load-model={name}" for name in self.load_models),
            f"--backend-config=python,shm-default-byte-size={self.shm_default_byte_size}",
            f"--backend-config=python,shm-growth-byte-size={self.shm_growth_byte_size}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_region_prefix}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
        ]
        if not self.auto_complete_config:
            args.append("--disable-auto-complete-config")
        if self.binary.cache_dir is not None:
            args.append(f"--cache-directory={self.binary.cache_dir}")
        return self.binary.command(*args, *self.extra_args)

    def environment(self) -> dict[str, str]:
        return server_environment(self.binary, self.python_env, pythonpath=self.pythonpath, extra=self.extra_env)

    def _launch_environment(self) -> dict[str, str]:
        """The environment, plus this server's gRPC address (its ports are picked by now): its models call
        `llm` through it (triton/grpc_llm.py says why not BLS)."""
        from cosyvoice_triton.triton.grpc_llm import SERVER_GRPC_ENV

        return {**self.environment(), SERVER_GRPC_ENV: self.grpc_url}

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "TritonProcess":
        if self.is_running():
            return self
        self.python_env.check_libpython()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="tritonserver-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        backend_dir = stage_backend_directory(self.binary, self.workdir / "backends", self.python_env.version)
        _warn_if_small_dev_shm()
        http, grpc, metrics = self._requested_ports  # a taken one would answer for another server
        check_ports_free(self.address or "0.0.0.0", {"tritonserver's HTTP port": http,
                                                     "tritonserver's gRPC port": grpc,
                                                     "tritonserver's metrics port": metrics})
        auto_ports = [p is None for p in self._requested_ports]
        clashes = crashes = 0
        while True:
            self._pick_ports()
            self._launch(backend_dir)
            try:
                self.wait_ready(self.startup_timeout_s)
                _LIVE.add(self)
                return self
            except TritonStartError as exc:
                # Killed by a signal before it was ready: python_backend gives up a stub that did not run for
                # a second while the server waited on its `initialize`, and the server dies of it
                # (`boost::interprocess::lock_exception`, SIGSEGV, SIGBUS: docs/operations/faults.md). The
                # models run below the stubs' health threads (triton/stub_priority.py), but a stall of the
                # whole machine can still do it; worth one more try.
                crashed = (self._proc.poll() or 0) < 0
                self._keep_workdir = True
                self.stop()
                if _PORT_CLASH in self._log_since_launch() and any(auto_ports) and clashes < 2:
                    clashes += 1
                    log.info("tritonserver port clash, picking new ports (attempt %d)", clashes + 1)
                elif crashed and crashes < 1:
                    crashes += 1
                    log.warning("tritonserver was killed by signal %d before it was ready (log %s); starting "
                                "it once more", -self.exit_code, self.log_path)
                else:
                    raise exc from None

    def restart(self) -> "TritonProcess":
        """Start again after the process exited on its own (a crash, a kill), on the ports it had, so
        the gateway, split frontends and clients keep its address. Its leftover stubs and /dev/shm
        regions are cleaned up first. Raises `TritonStartError` when it does not come up (a port taken
        meanwhile: ports are not picked again)."""
        if self.is_running():
            return self
        pgid = self.pid
        self.stop()  # reap the old process: its group (stubs) killed, its shm regions removed
        if pgid is not None:
            _wait_group_gone(pgid, GROUP_GONE_TIMEOUT_S)  # a dying stub still holds the stub binary we copy
        self._requested_ports = (self.http_port, self.grpc_port, self.metrics_port)
        return self.start()

    def _pick_ports(self) -> None:
        fresh = iter(_free_ports(self.address or "0.0.0.0", 3))
        self.http_port, self.grpc_port, self.metrics_port = (
            p if p is not None else next(fresh) for p in self._requested_ports)

    def _launch(self, backend_dir: Path) -> None:
        cmd = self.command(backend_dir)
        self._log_file = open(self.log_path, "ab")
        self._log_offset = self._log_file.tell()
        self._log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log_file.flush()
        self.returncode = None
        self._proc = subprocess.Popen(term_with_parent(cmd) if self.die_with_parent else cmd,
                                      stdout=self._log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=self._launch_environment(),
                                      cwd=self.workdir, start_new_session=True)
        log.info("tritonserver pid %d: http %s grpc %s metrics %s, log %s", self._proc.pid,
                 self.http_url, self.grpc_url, self.metrics_url, self.log_path)

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The exit code of the last process (negative: a signal); None while it runs or before it started."""
        return self._proc.poll() if self._proc is not None else self.returncode

    def is_ready(self, timeout_s: float = 2.0) -> bool:
        """True when `/v2/health/ready` answers 200."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def _metrics_listening(self) -> bool:
        try:
            socket.create_connection((self.client_host, self.metrics_port), timeout=1.0).close()
            return True
        except OSError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Poll readiness until `timeout_s` passes; waiting on the process between polls, so an exit
        ends the wait at once."""
        assert self._proc is not None, "not started"
        deadline = time.monotonic() + timeout_s
        interval = 0.05
        while True:
            if self._proc.poll() is not None:
                raise TritonStartError(
                    f"tritonserver exited with code {self._proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            # Ready over HTTP, and the metrics endpoint listening: Triton opens it a few ms after the
            # others, and a caller's first act may be to read the counters.
            if self.is_ready(timeout_s=1.0) and self._metrics_listening():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TritonStartError(
                    f"tritonserver not ready after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")
            try:
                self._proc.wait(timeout=min(interval, remaining))
            except subprocess.TimeoutExpired:
                pass
            interval = min(interval * 2, 0.5)

    def kill(self) -> None:
        """SIGKILL the server and its stubs now (a hung server: server/liveness.py); `restart()` cleans up."""
        if self._proc is not None and self._proc.poll() is None:
            _kill_group(self._proc.pid)
            self._proc.wait()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGINT, then SIGKILL to the whole process group after `grace_s` (default: the exit timeout
        plus 5 s). Returns the exit code (negative for a signal), None if it never started."""
        proc = self._proc
        if proc is None:
            return self.returncode
        grace = self.exit_timeout_s + 5 if grace_s is None else grace_s
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver pid %d ignored SIGINT for %.0f s; killing it", proc.pid, grace)
                _kill_group(proc.pid)
                proc.wait()
        _kill_group(proc.pid)  # stubs left behind by a crashed server
        self.returncode = proc.returncode
        self._proc = None
        _LIVE.discard(self)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _remove_shm_regions(self.shm_region_prefix)
        if self._own_workdir and self.workdir is not None and self.returncode == 0 and not self._keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)  # a failed server's log stays for the error message
            self.workdir = None
        return self.returncode

    def _log_since_launch(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode("utf-8", errors="replace")

    def loaded_models(self) -> list[str]:
        """The models this launch's log reports loaded so far (tritonserver opens its ports after all)."""
        if self._proc is None or not self.log_path.exists():
            return []
        return _LOADED.findall(self._log_since_launch())

    def log_tail(self, lines: int = 60) -> str:
        if self.workdir is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            tail = deque(f, maxlen=lines)
        return b"".join(tail).decode("utf-8", errors="replace")

    def __enter__(self) -> "TritonProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.is_running() else "stopped"
        return f"TritonProcess({self.model_repository}, {state}, grpc {self.grpc_url})"


# The child asks for its parent-death signal itself, then becomes the command. A `preexec_fn` would
# do the same between fork and exec in *this* process, but it makes subprocess fork() instead of vfork():
# the fork runs every atfork handler (gRPC's among them) in a process whose other threads are mid-call,
# which the Python docs call unsafe with threads and which gRPC's fork support has crashed on. The
# parent's pid is passed so that a parent gone before prctl ran is seen (the child then exits).
_PARENT_DEATH_EXEC = ("import ctypes, os, signal, sys; "
                      "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
                      "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
                      "os.execvp(sys.argv[2], sys.argv[2:])")


def term_with_parent(command: Sequence[str]) -> list[str]:
    """`command` started so that the kernel sends it SIGTERM (a graceful stop) when the parent dies.
    Linux ties this to the *thread* that started the child, so only use it from a long-lived thread."""
    return [sys.executable, "-I", "-S", "-c", _PARENT_DEATH_EXEC, str(os.getpid()), *command]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no process of group `pgid` is left (True), or `timeout_s` passed (False: an unreaped
    zombie, where the container's init does not reap)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        time.sleep(0.05)
    return False


def _remove_shm_regions(prefix: str) -> None:
    shm = Path("/dev/shm")
    if shm.is_dir():
        for region in shm.glob(prefix + "*"):
            region.unlink(missing_ok=True)


def _warn_if_small_dev_shm(minimum: int = 256 * MiB) -> None:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return
    free = stat.f_bavail * stat.f_frsize
    if free < minimum:
        log.warning("/dev/shm has only %d MiB free; Python models may fail with 'shm full' "
                    "(docker: --shm-size=1g)", free // MiB)
