"""`cosyvoice-triton serve`: render the model repository for one run and keep a tritonserver on it.

1. The model folder: `--model-dir` (a folder or a hub id), or else a tiny random folder made on first
   use under `$COSYVOICE_HOME/models/tiny` (default `~/.cache/cosyvoice_triton`).
2. The run folder (`--run-dir`, default `$COSYVOICE_HOME/runs/<time>-<pid>`): `repo/` holds every model
   of `model_repository/` with its `config.pbtxt` filled from `ServeOptions` (`repository_values`;
   the filler refuses unknown keys and leftovers), `tritonserver.log` the server's output.
3. `TritonProcess` starts the server (the nvidia-pytriton binary, or a system `tritonserver`) and waits
   for readiness; the endpoints are printed; Ctrl-C or SIGTERM stops it gracefully.

The voice store defaults to `$COSYVOICE_HOME/voices.sqlite`, so registered voices survive restarts.

Engines (`--engine`, `--precision`, `--ort-providers`): token2wav's flow encoder, flow estimator and
HiFT decode run on torch, ONNX Runtime (on the providers of `--ort-providers`), OpenVINO or TensorRT;
CAM++ on ONNX Runtime, on OpenVINO with `--engine openvino`, or on TensorRT with `--engine tensorrt` on a
GPU. `--device` is checked at start (engines/providers.py: xpu, npu, mps, ... need their torch plugin
and a device). The default is torch: it is the reference that the golden tests check, and it needs no
export.
(On a 2-core CPU, ONNX Runtime ran the tiny folder's token2wav 1.2-1.7x faster, single-threaded.)
The ONNX graphs are exported on first use into `<model dir>/onnx`, or `<run dir>/onnx` when the model
folder is read-only (`--onnx-dir` chooses); TensorRT plans are cached under `<onnx dir>/trt`. An
engine that cannot run here falls back (tensorrt -> onnxruntime -> torch) with one warning line in the
server's log.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from cosyvoice_triton.config import ModelPaths
from cosyvoice_triton.pipeline.threads import available_cores
from cosyvoice_triton.server.process import TritonProcess, describe_exit
from cosyvoice_triton.server.templates import model_names, render_repository
from cosyvoice_triton.targets import TritonTarget, check_spec, is_discovery
from cosyvoice_triton.family import COSYVOICE2 as COSYVOICE2_FAMILY, family_of
from cosyvoice_triton.wire.names import FAMILY_MODELS, OFFICIAL_MODELS
from cosyvoice_triton.wire.official import NATIVE_FORM, OFFICIAL_FORM
from cosyvoice_triton.triton.params import Engine, Precision

ENGINES = typing.get_args(Engine)  # torch | onnxruntime | openvino | tensorrt
PRECISIONS = typing.get_args(Precision)  # fp32 | fp16 | bf16

log = logging.getLogger(__name__)

# The templates: model_repository/ of the checkout (an editable install), or the copy a wheel carries
# as package data in cosyvoice_triton/model_repository (pyproject.toml).
REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGED_REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
DEFAULT_REPOSITORY = PACKAGED_REPOSITORY if PACKAGED_REPOSITORY.is_dir() else REPO_ROOT / "model_repository"


def cosyvoice_home() -> Path:
    return Path(os.environ.get("COSYVOICE_HOME", "~/.cache/cosyvoice_triton")).expanduser()


@dataclass
class ServeOptions:
    model_dir: Path | None = None  # None: the tiny random folder, made on first use
    run_dir: Path | None = None  # None: a fresh folder under $COSYVOICE_HOME/runs
    repository: Path = DEFAULT_REPOSITORY  # the templates
    address: str = "127.0.0.1"  # loopback: only this machine reaches Triton (which has no keys or limits)
    http_port: int | None = 8000  # None: a free port
    grpc_port: int | None = 8001
    metrics_port: int | None = 8002
    device: str = "cpu"  # cpu | cuda | cuda:N | xpu | npu | mps ...: torch device of llm and token2wav
    instances: int = 1  # instances of the stateless models (the synthesis models, prompt steps, register_voice)
    workers: int = 16  # requests synthesized at once per cosyvoice2 instance
    max_pending: int = 64  # requests queued per cosyvoice2 instance beyond that
    max_queue_wait_s: float = 2.0  # a request that would wait longer to start is refused (admission.py)
    # streams in real-time units (pipeline/capacity.py): every running stream this many times faster than real
    # time, or a new one waits. 0 (off) here, so tests and in-process users keep cost-based admission; `serve`
    # and `up` turn it on (1.2)
    realtime_margin: float = 0.0
    realtime_capacity: float | None = None  # audio seconds per second per cosyvoice2 instance; None: measured
    voice_store: str | None = None  # sqlite path or redis:// url; None: $COSYVOICE_HOME/voices.sqlite
    llm_max_batch: int = 8
    llm_max_seq_len: int = 4096
    llm_max_queue: int = 64
    max_token_text_ratio: float | None = None  # None: the model's (20); lower only to shorten tests
    t2w_max_streams: int = 64
    t2w_max_batch: int = 16
    t2w_idle_timeout_s: float = 120.0  # quiet seconds without a chunk before token2wav frees a stream (idle rule)
    flow_cache_frames: int | None = None  # per token2wav stream (models/flow_cache.py); 0: off; None: the family's
    prompt_cache_mb: float = 512.0  # token2wav: voices' prompt frames kept (models/prompt_cache.py); 0: off
    t2w_queue_delay_us: int = 500
    prompt_max_batch: int = 8
    prompt_queue_delay_us: int = 1000
    torch_threads: int = 0  # per llm / token2wav instance; 0: chosen from the core count (pipeline/threads.py)
    llm_precision: str = "fp32"  # the LLM backbone's: fp32 | bf16 | int8 | auto (models/auto_precision.py)
    flow_precision: str = "fp32"  # the torch flow estimator's: fp32 | bf16 | auto (the CLI's default: auto)
    compile: str = "off"  # torch.compile of the hot loops' blocks: off | auto | on (models/compiled.py)
    cuda_graphs: str = "auto"  # the LLM's decode step and the flow estimator's step: off | auto | on (engines/cuda_graphs.py)
    engine: str = "torch"  # token2wav: torch | onnxruntime | openvino | tensorrt (CAM++ too; torch: onnxruntime)
    precision: str = "fp32"  # of TensorRT plans and OpenVINO's hint: fp32 | fp16 | bf16
    ort_providers: str | None = None  # with engine onnxruntime: execution providers (engines/providers.py)
    onnx_dir: Path | None = None  # exported graphs and TensorRT plans; None: see `default_onnx_dir`
    max_text_chars: int = 2000
    # Split deployment: "frontend" (cosyvoice2, llm, prompt encoder, voice registration; token2wav on
    # `backends`), "backend" (token2wav only), or "all" (every model in one server, the default).
    role: str = "all"
    backends: tuple[str, ...] = ()  # token2wav servers of a frontend: grpc://host:port[?metrics=URL]
    token2wav_timeout_s: float = 60.0  # a frontend's longest wait for one remote token2wav chunk
    chunk_policy: str = "fixed"  # fixed | adaptive: cosyvoice2's chunk policy for requests that name none
    chunk_preset: str = "official"  # official | quick: the chunk schedule's defaults (pipeline/chunk_policy.py)
    # cosyvoice2_official and cosyvoice2_official_offline too (cosyvoice3_official* on a CosyVoice3 folder): the
    # family's synthesis model in the official runtime's tensor form, for the official Triton clients
    # (wire/official.py). Off here, so tests and in-process users stay lean (two more Python model processes);
    # `serve` and `up` turn it on.
    official_models: bool = False
    startup_timeout_s: float = 300.0
    extra_args: list[str] = field(default_factory=list)  # more tritonserver flags


CORE_SHARE_FILE = "core_share"  # in the run folder (pipeline/shared_cores.py)
# (decoupled, max_batch_size, tensor form) of each family's synthesis models, in FAMILY_MODELS' order: streaming,
# offline, then the official form's two (the official config batches: [1, ...] tensors, no dynamic batcher).
SYNTHESIS_KINDS = ((True, 0, NATIVE_FORM), (False, 0, NATIVE_FORM), (True, 1, OFFICIAL_FORM), (False, 1, OFFICIAL_FORM))


def default_model_dir() -> Path:
    """The tiny random model folder, written on first use (atomically: a half-written one never shows)."""
    from cosyvoice_triton.random_folder.marker import is_random, mark_random

    target = cosyvoice_home() / "models" / "tiny"
    if (target / "cosyvoice2.yaml").exists() and (target / "speech_tokenizer_v2.onnx").exists():
        if not is_random(target):  # made before random folders said so
            mark_random(target)
        return target
    from cosyvoice_triton.random_folder.write import write_random_model

    staging = target.parent / f".tiny-{os.getpid()}"
    write_random_model(staging, size="tiny")
    try:
        staging.rename(target)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


def check_model_folder(model_dir: Path) -> None:
    """Raise ModelFolderError naming what `model_dir` lacks of the released layout of its family."""
    from cosyvoice_triton.errors import ModelFolderError

    if not model_dir.is_dir():
        raise ModelFolderError(f"model folder {model_dir} does not exist")
    missing = ModelPaths(model_dir).missing()
    if missing:
        raise ModelFolderError(f"{model_dir} is not a CosyVoice2 or CosyVoice3 model folder (the released "
                               f"CosyVoice2-0.5B or Fun-CosyVoice3-0.5B-2512 layout): missing {', '.join(missing)}")


def default_onnx_dir(model_dir: Path, run_dir: Path) -> Path | None:
    """Where the graph engines export to when `--onnx-dir` is not given: None (the models' default,
    `<model_dir>/onnx`) if that can be written, else `<run_dir>/onnx` (a read-only model folder)."""
    target = model_dir / "onnx"
    writable = os.access(target, os.W_OK | os.X_OK) if target.exists() else os.access(model_dir, os.W_OK | os.X_OK)
    return None if writable else run_dir / "onnx"


def resolve_voice_store(url: str | None) -> str:
    return url if url else str(cosyvoice_home() / "voices.sqlite")


ROLES = ("all", "frontend", "backend")
BACKEND_MODELS = ("token2wav",)  # what a backend server holds; a frontend holds the rest


def served_family(model_dir: Path) -> str:
    """The family whose synthesis models a server of `model_dir` serves: the folder's (`prepare` has checked it);
    a folder not written yet (a repository rendered on its own) is CosyVoice2's."""
    return family_of(model_dir).name if Path(model_dir).is_dir() else COSYVOICE2_FAMILY.name


def role_models(options: ServeOptions, available: list[str], family: str = COSYVOICE2_FAMILY.name) -> list[str]:
    """The models one server of `options.role` serves, out of the repository's `available` ones: the synthesis
    models of `family` only, named for it (cosyvoice2*, cosyvoice3*); the official tensor form's models only with
    `options.official_models`; a backend holds token2wav alone."""
    if options.role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {options.role!r}")
    if options.role == "frontend" and not options.backends:
        raise ValueError("a frontend needs at least one token2wav backend: --backend grpc://host:port")
    if options.role != "frontend" and options.backends:
        raise ValueError(f"--backend is for --role frontend (this server's role is {options.role})")
    for spec in options.backends:
        check_spec(spec, "--backend")  # a bad address fails here, not inside tritonserver
    others = {name for other, names in FAMILY_MODELS.items() if other != family for name in names}
    available = [name for name in available if name not in others]
    if not options.official_models:
        available = [name for name in available if name not in OFFICIAL_MODELS]
    if options.role == "backend":
        return [name for name in available if name in BACKEND_MODELS]
    if options.role == "frontend":
        return [name for name in available if name not in BACKEND_MODELS]
    return list(available)


def backend_spec(spec: str) -> str:
    """A `--backend` as the frontend's config holds it: DNS specs as given, addresses with their metrics URL."""
    return spec.strip() if is_discovery(spec) else TritonTarget.parse(spec, "--backend").spec


def repository_values(options: ServeOptions, model_dir: Path, voice_store: str,
                      core_share: str | Path = "") -> dict[str, dict[str, object]]:
    """The `${key}` values of every model template. `core_share`: the file through which this server's
    llm and token2wav share the cores (pipeline/shared_cores.py); empty: fixed shares. `auto` precisions
    are resolved here, on the machine the server runs on, so each config names the precision it runs."""
    from cosyvoice_triton.models.auto_precision import resolve_flow_precision, resolve_llm_precision
    from cosyvoice_triton.engines.cuda_graphs import check_cuda_graphs_setting
    from cosyvoice_triton.models.compiled import check_compile_setting

    if options.engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {options.engine!r}")
    if options.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {options.precision!r}")
    gpu = options.device.startswith("cuda")
    # One instance of llm / token2wav on one device (see their config.pbtxt); "cuda:N" picks GPU N.
    placement = f"kind: KIND_GPU gpus: [ {options.device.partition(':')[2] or 0} ]" if gpu else "kind: KIND_CPU"
    torch_device = "cuda" if gpu else options.device  # a KIND_GPU instance maps "cuda" to its own GPU
    onnx_device = "auto" if gpu else "cpu"  # the S3 tokenizer on the GPU when onnxruntime has CUDA
    ratio = "" if options.max_token_text_ratio is None else options.max_token_text_ratio
    onnx_dir = "" if options.onnx_dir is None else options.onnx_dir
    # CAM++ ships as ONNX only: TensorRT when asked for (on the GPU), OpenVINO when asked for, else ONNX
    # Runtime on the CPU.
    campplus_engine, campplus_device = {"tensorrt": ("tensorrt", options.device),
                                        "openvino": ("openvino", "cpu")}.get(options.engine, ("onnxruntime", "cpu"))
    providers = options.ort_providers or ""
    synthesis = {"model_dir": model_dir, "voice_store": voice_store, "instances": options.instances,
                 "max_workers": options.workers, "max_pending": options.max_pending,
                 "max_queue_wait_s": options.max_queue_wait_s, "realtime_margin": options.realtime_margin,
                 "realtime_capacity": options.realtime_capacity or 0.0,
                 "max_text_chars": options.max_text_chars, "max_seq_len": options.llm_max_seq_len,
                 "token2wav_backends": ",".join(backend_spec(b) for b in options.backends),
                 "token2wav_timeout_s": options.token2wav_timeout_s, "chunk_policy": options.chunk_policy,
                 "chunk_preset": options.chunk_preset}
    prompt_step = {"model_dir": model_dir, "instances": options.instances, "max_batch": options.prompt_max_batch,
                   "queue_delay_us": options.prompt_queue_delay_us}
    return {
        **{name: {**synthesis, "name": name, "family": family, "decoupled": decoupled, "max_batch_size": batch,
                  "tensor_form": form}
           for family, models in FAMILY_MODELS.items()
           for name, (decoupled, batch, form) in zip(models, SYNTHESIS_KINDS, strict=True)},
        "llm": {"model_dir": model_dir, "placement": placement, "device": torch_device,
                "max_batch": options.llm_max_batch, "max_seq_len": options.llm_max_seq_len,
                "max_queue": options.llm_max_queue, "max_token_text_ratio": ratio,
                "torch_threads": options.torch_threads, "core_share": core_share,
                "precision": resolve_llm_precision(options.llm_precision, torch_device),
                "compile": check_compile_setting(options.compile),
                "cuda_graphs": check_cuda_graphs_setting(options.cuda_graphs)},
        "token2wav": {"model_dir": model_dir, "placement": placement, "device": torch_device,
                      "max_streams": options.t2w_max_streams, "max_batch": options.t2w_max_batch,
                      "idle_timeout_s": options.t2w_idle_timeout_s,
                      # None: the family's default (ModelFamily.flow_cache_frames), read by the model
                      "flow_cache_frames": "" if options.flow_cache_frames is None else options.flow_cache_frames,
                      "queue_delay_us": options.t2w_queue_delay_us,
                      "prompt_cache_mb": options.prompt_cache_mb,
                      "flow_precision": resolve_flow_precision(options.flow_precision, torch_device),
                      "chunk_preset": options.chunk_preset, "compile": options.compile,
                      "cuda_graphs": options.cuda_graphs,
                      # A backend server runs token2wav alone: every core (pipeline/threads.py).
                      "torch_threads": options.torch_threads or (available_cores() if options.role == "backend" else 0),
                      "core_share": core_share,
                      "engine": options.engine,
                      "precision": options.precision, "onnx_dir": onnx_dir, "ort_providers": providers},
        "prompt_encoder": {"max_batch": options.prompt_max_batch},
        "prompt_audio": prompt_step,
        "speaker_embedding": {**prompt_step, "engine": campplus_engine, "device": campplus_device,
                              "onnx_dir": onnx_dir, "ort_providers": providers},
        "audio_tokenizer": {**prompt_step, "device": onnx_device},
        "register_voice": {"model_dir": model_dir, "voice_store": voice_store, "instances": options.instances,
                           "max_seq_len": options.llm_max_seq_len},
    }


def render_run_repository(options: ServeOptions, model_dir: Path, voice_store: str, dst: Path) -> Path:
    """Lay out every model of `options.repository` in `dst` with filled configs; llm and token2wav share
    the cores through `core_share` beside `dst`."""
    values = repository_values(options, model_dir, voice_store, core_share=Path(dst).parent / CORE_SHARE_FILE)
    models = role_models(options, model_names(options.repository), served_family(model_dir))
    # A run folder given again (`--run-dir`, as a restarted `up` does): this run's models only.
    shutil.rmtree(dst, ignore_errors=True)
    return render_repository(options.repository, dst, {k: v for k, v in values.items() if k in models},
                             models=models)


def new_run_dir() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = cosyvoice_home() / "runs" / f"{stamp}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def prepare(options: ServeOptions, **process_kwargs) -> TritonProcess:
    """Model folder, run folder and a `TritonProcess` ready to start (not started). `process_kwargs` go
    to `TritonProcess` (tests pass `die_with_parent`, `binary`)."""
    from cosyvoice_triton.engines.providers import check_torch_device, parse_providers
    from cosyvoice_triton.model_hub import resolve_model_dir

    check_torch_device(options.device)  # a device torch cannot use here fails now, not inside tritonserver
    if options.ort_providers:
        parse_providers(options.ort_providers)  # a malformed list fails now; availability is checked at load
    model_dir = Path(resolve_model_dir(str(options.model_dir))) if options.model_dir else default_model_dir()
    model_dir = model_dir.resolve()
    check_model_folder(model_dir)  # now, not after tritonserver has tried to load it
    for line in ModelPaths(model_dir).unused():
        log.warning("%s: %s", model_dir, line)
    run_dir = Path(options.run_dir) if options.run_dir else new_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    if options.onnx_dir is not None:
        options = replace(options, onnx_dir=Path(options.onnx_dir).expanduser().resolve())
    elif options.engine != "torch":
        options = replace(options, onnx_dir=default_onnx_dir(model_dir, run_dir))
    repo = render_run_repository(options, model_dir, resolve_voice_store(options.voice_store), run_dir / "repo")
    return TritonProcess(repo, workdir=run_dir, address=options.address, http_port=options.http_port,
                         grpc_port=options.grpc_port, metrics_port=options.metrics_port,
                         startup_timeout_s=options.startup_timeout_s, extra_args=options.extra_args,
                         **process_kwargs)


def rendered_parameter(repo: Path, model: str, key: str) -> str | None:
    """A `parameters` value of a rendered config.pbtxt, or None when the model or the key is not there."""
    path = Path(repo) / model / "config.pbtxt"
    if not path.exists():
        return None
    match = re.search(r'key: "%s" value: \{ string_value: "([^"]*)" \}' % re.escape(key), path.read_text())
    return match.group(1) if match else None


def precision_summary(repo: Path) -> str:
    """What the llm and token2wav of a rendered repository compute in, and the CPU kind `auto` read."""
    from cosyvoice_triton.models.auto_precision import describe_cpu

    parts = [f"{label} {value}" for label, model, key in (("LLM", "llm", "precision"),
                                                          ("flow", "token2wav", "flow_precision"))
             if (value := rendered_parameter(repo, model, key)) is not None]
    return f"{', '.join(parts) or 'n/a'} (CPU: {describe_cpu()})"


def describe(server: TritonProcess, model_dir_hint: str, out: TextIO) -> None:
    host = server.client_host if server.address in ("0.0.0.0", "") else server.address
    names = model_names(server.model_repository)
    print(f"cosyvoice-triton: serving {model_dir_hint}", file=out)
    print(f"  models   {', '.join(names)}", file=out)
    synthesis = [models for models in FAMILY_MODELS.values() if models[0] in names]
    if synthesis:
        streaming, offline, official, official_offline = synthesis[0]
        print(f"  HTTP     http://{host}:{server.http_port}   (whole waveform: POST /v2/models/{offline}/infer)",
              file=out)
        print(f"  gRPC     {host}:{server.grpc_port}   (streaming: model {streaming})", file=out)
        if official in names:
            print(f"  official {official} (streaming), {official_offline} (whole waveform): "
                  f"the official Triton clients' tensors (--model-name)", file=out)
    else:  # a split deployment's backend: frontends call it
        print(f"  gRPC     {host}:{server.grpc_port}   (give frontends --backend grpc://{host}:{server.grpc_port})",
              file=out)
    print(f"  metrics  http://{host}:{server.metrics_port}/metrics", file=out)
    print(f"  precision {precision_summary(server.model_repository)}", file=out)
    print(f"  log      {server.log_path}", file=out)
    print("Press Ctrl-C to stop.", file=out, flush=True)


def serve(options: ServeOptions, out: TextIO = sys.stdout) -> int:
    """Start the server, print its endpoints, block until Ctrl-C / SIGTERM or until it exits."""
    server = prepare(options)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"starting tritonserver (log: {server.workdir / 'tritonserver.log'}) ...", file=out, flush=True)
        server.start()
        describe(server, str(options.model_dir or "the tiny random model"), out)
        while not stop.wait(0.5):
            if not server.is_running():  # not restarted here: `cosyvoice-triton up` supervises and restarts
                print(f"tritonserver exited on its own ({describe_exit(server.exit_code)}): serve stops with exit "
                      f"code 1 (`cosyvoice-triton up` restarts it instead); log {server.log_path}:\n"
                      f"{server.log_tail(20)}", file=sys.stderr, flush=True)
                return 1
        print("stopping tritonserver ...", file=out, flush=True)
        return 0
    finally:
        code = server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            print(f"tritonserver stopped (exit code {code})", file=out, flush=True)
