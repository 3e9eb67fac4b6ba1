"""The whole service for client and page tests: a real tritonserver (through the launcher, on a tiny random
model, free ports) and the aiohttp gateway in front of it, served from a thread of the test process
(`cosyvoice_triton.gateway.testing.GatewayThread`).

```
with serve_stack(tmp_path_factory.mktemp("stack")) as stack:
    stack.triton.grpc_url, stack.gateway_url, stack.model_dir
```
The server runs with max_token_text_ratio 3 (the random LLM rarely stops on its own; 3 speech tokens per
text token keeps requests short) and one torch thread per model. Skips, naming the reason, when no
tritonserver can be found. Both voice stores are the same SQLite file, as with `cosyvoice-triton up`.
Given a model folder, the tritonserver is shared by every module of the session that asks for the same
folder and options (the gateway is each module's own); `triton_server(..., shared=False)` gives a private one.
"""
from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

RATIO = 3.0


@dataclass
class Stack:
    triton: object  # TritonProcess
    gateway_url: str  # http://127.0.0.1:PORT
    model_dir: Path
    voice_store: str


# Servers shared by the whole session, keyed by model folder: each start of the tiny stack costs
# tens of seconds on 2 cores, and most modules need the same one. Stopped by `stop_shared_servers`
# (tests/conftest.py, at the session's end).
_shared_servers: dict[tuple, tuple[object, Path, str]] = {}
_shared_exits = ExitStack()


@contextmanager
def triton_server(root: Path, model_dir: Path | None = None, *, shared: bool = True,
                  **options) -> Iterator[tuple[object, Path, str]]:
    """A tritonserver on `model_dir` (a new tiny random folder when None). `options`: more ServeOptions
    (e.g. max_queue_wait_s). With a folder given, no options and `shared` (the default), callers with the
    same folder get one server, started by the first under its `root` and kept running (with its voice
    store) until the session ends; pass shared=False for a server of your own (one a test stops or
    kills, or whose counters must start at zero)."""
    if model_dir is None or not shared or options:
        with _own_triton_server(root, model_dir, **options) as server:
            yield server
        return
    key = (Path(model_dir).resolve(),)
    if key not in _shared_servers or not _shared_servers[key][0].is_running():
        _shared_servers[key] = _shared_exits.enter_context(_own_triton_server(root, model_dir, **options))
    yield _shared_servers[key]


def stop_shared_servers() -> None:
    _shared_exits.close()
    _shared_servers.clear()


@contextmanager
def _own_triton_server(root: Path, model_dir: Path | None = None, **options) -> Iterator[tuple[object, Path, str]]:
    from cosyvoice_triton.random_folder.write import write_random_model
    from cosyvoice_triton.server.launcher import ServeOptions, prepare
    from triton_harness import tritonserver_or_skip

    binary = tritonserver_or_skip()
    if model_dir is None:
        model_dir = write_random_model(root / "model", size="tiny", seed=0)
    voice_store = str(root / "voices.sqlite")
    options = ServeOptions(model_dir=model_dir, run_dir=root / "run", address="127.0.0.1", http_port=None,
                           grpc_port=None, metrics_port=None, voice_store=voice_store, max_token_text_ratio=RATIO,
                           torch_threads=1, **{"workers": 4, **options})
    server = prepare(options, binary=binary, die_with_parent=True)
    server.start()
    try:
        yield server, model_dir, voice_store
    finally:
        server.stop()


def wait_ready(url: str, timeout_s: float = 120.0) -> dict:
    """Poll /readyz until the gateway is ready with voice "default" registered."""
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as response:
                body = json.loads(response.read())
                if body.get("ready") and body.get("default_voice") == "ready":
                    return body
        except OSError as exc:  # 503 while not ready
            body = {"error": str(exc)}
        time.sleep(0.2)
    raise TimeoutError(f"gateway at {url} not ready in {timeout_s:.0f} s: {body}")


@contextmanager
def gateway(triton, root: Path, model_dir: Path, voice_store: str) -> Iterator[str]:
    """The gateway (`cosyvoice_triton.gateway.testing.GatewayThread`) on a free port; yields its URL once
    it is ready with voice "default" registered."""
    from cosyvoice_triton.gateway.config import GatewayConfig
    from cosyvoice_triton.gateway.testing import GatewayThread

    config = GatewayConfig(triton=(triton.target,),
                           voice_store=voice_store, model_dir=model_dir, home=root, shutdown_timeout_s=5.0)
    with GatewayThread(config) as thread:
        wait_ready(thread.url)
        yield thread.url


@contextmanager
def serve_stack(root: Path, model_dir: Path | None = None) -> Iterator[Stack]:
    with triton_server(root, model_dir) as (server, model_dir, voice_store):
        with gateway(server, root / "gateway", model_dir, voice_store) as url:
            yield Stack(triton=server, gateway_url=url, model_dir=model_dir, voice_store=voice_store)


def library_pipeline(stack: Stack, voice_id: str = "default"):
    """The library's pipeline on the stack's folder, set up as the stack's server is (ratio, one torch
    thread), and the stored voice `voice_id`: (CosyVoice2, PromptFeatures) for audio to compare with."""
    import torch

    from cosyvoice_triton.pipeline.cosyvoice2 import CosyVoice2
    from cosyvoice_triton.voices.stores import open_voice_store

    torch.set_num_threads(1)
    tts = CosyVoice2.from_model_dir(stack.model_dir)
    tts.llm.config.max_token_text_ratio = RATIO
    store = open_voice_store(stack.voice_store)
    try:
        return tts, store.get(voice_id)
    finally:
        store.close()


def stub_pid(server, model: str) -> int:
    """The pid of `server`'s Python-backend stub for `model` (its command line names the model file of
    this server's repository, not another server's)."""
    model_file = f"{server.model_repository}/{model}/1/model.py"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if model_file in (proc / "cmdline").read_bytes().decode(errors="replace"):
                return int(proc.name)
        except OSError:
            continue
    raise LookupError(f"no stub of {model} for {server.model_repository}")
