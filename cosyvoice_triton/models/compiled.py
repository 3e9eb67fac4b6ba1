"""Compiled hot loops: `torch.compile` (inductor) of the blocks that the flow estimator, the LLM decoder and
HiFT repeat, compiled once per process and shape, cached on disk, eager after a failure.

Regional compilation. What is compiled is a block class's forward (the estimator's `TransformerBlock`, the
Qwen2 `DecoderLayer`, HiFT's `ResBlock`), not a whole model: every instance of the class runs the same
compiled graph (its weights are the graph's inputs), so the 56 transformer blocks of the estimator cost one
compilation, not 56 (the whole estimator took 228 s to compile on 2 cores, perf/RESULTS.md). The fusions
that pay on a CPU (norms, activations, masks and residual adds around the matrix products) all live inside
a block.

Shapes. The dims that vary from call to call (rows, frames, the LLM's attended cache length) are marked
dynamic (`torch._dynamo.maybe_mark_dynamic`), so one graph serves every size; torch still specializes sizes
0 and 1, so a block has a few graphs (the LLM layer: decode with one row and with several; the estimator
block: the full pass, a cached pass with no cached frames and one with some). `graphs()` counts them. The
LLM compiles its decode steps only: a prefill runs once per request, at a length of its own.

Disk cache. Inductor's FX-graph and AOT caches (on by default) live under `TORCHINDUCTOR_CACHE_DIR`, set
here to $COSYVOICE_HOME/inductor (~/.cache/cosyvoice_triton/inductor) unless the environment names one: a new process traces the
blocks again but skips inductor's code generation and the C++ build.

Warm-up. `apply_compile` runs each compiled module on zeros once per graph it expects (one row and two;
HiFT short and long), so the graphs are built while the model loads, not during a stream's first chunk.

Fallback. A compiled call that fails where the eager call succeeds (no C++ compiler, an operator inductor
cannot lower) logs one line and turns that block class eager for the process; on a platform torch.compile
does not support, `apply_compile` logs one line and compiles nothing.

Setting (`serve --compile`, `CosyVoice2(compile=...)`): off | on | auto; auto compiles the modules that
measured faster compiled on this device kind (`AUTO_MODULES`, from perf/RESULTS.md).
"""
from __future__ import annotations

import codecs
import functools
import locale
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

COMPILE_SETTINGS = ("off", "auto", "on")
COMPILED_MODULES = ("llm", "flow", "hift")
# auto: the modules whose compiled blocks measured faster per call than eager on this device kind
# (perf/RESULTS.md, "Compiled hot loops"). On CPUs HiFT only: its residual blocks fuse the Snake
# activations around the convolutions (1.1-1.5x a call); the flow estimator's and the LLM's steps are bound
# by their matrix products and measured no faster (0.7-1.1x, noise included). GPUs: not measured yet, so nothing.
AUTO_MODULES: dict[str, frozenset[str]] = {"cpu": frozenset({"hift"}), "cuda": frozenset()}
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
WARM_FRAMES = 60  # frames of the warm-up inputs (any count: those dims are dynamic)
WARM_SHORT_FRAMES = 8  # HiFT's short warm-up call (a stream's last chunk may be this short)
RECOMPILE_LIMIT = 64  # graphs per block class (dynamo's default, 8, is too few: HiFT's ResBlock has 9 shapes x 4)


def check_compile_setting(setting: str) -> str:
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_SETTINGS)}, got {setting!r}")
    return setting


def compiled_modules(setting: str, device: torch.device | str) -> tuple[str, ...]:
    """Which of COMPILED_MODULES `setting` compiles on `device` (auto: AUTO_MODULES of its kind)."""
    check_compile_setting(setting)
    if setting == "off":
        return ()
    if setting == "on":
        return COMPILED_MODULES
    wanted = AUTO_MODULES.get(torch.device(device).type, frozenset())
    return tuple(module for module in COMPILED_MODULES if module in wanted)


def unsupported_reason() -> str | None:
    """Why torch.compile cannot run in this process, or None."""
    if sys.platform == "win32":
        return "inductor's C++ backend is not supported on Windows here"
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support Python {sys.version_info.major}.{sys.version_info.minor}"
    return None


def default_cache_dir() -> Path:
    """$COSYVOICE_HOME/inductor (the home of the server's run folders and voices; ~/.cache/cosyvoice_triton)."""
    return Path(os.environ.get("COSYVOICE_HOME", "~/.cache/cosyvoice_triton")).expanduser() / "inductor"


def use_disk_cache(directory: str | Path | None = None) -> Path:
    """Point inductor's caches at `directory` (default: the environment's TORCHINDUCTOR_CACHE_DIR, else
    `default_cache_dir()`); returns the directory used. Call before the first compilation."""
    if directory is not None:
        os.environ[CACHE_ENV] = str(directory)
    os.environ.setdefault(CACHE_ENV, str(default_cache_dir()))
    path = Path(os.environ[CACHE_ENV])
    path.mkdir(parents=True, exist_ok=True)
    return path


class CompiledForward:
    """One compiled forward shared by the instances of a block class; `wrap(module)` routes a module's calls
    through it. `dynamic[i]`: the dims of positional argument i that vary between calls (a list argument: of
    each tensor in it). `hot(*args)`: whether a call is one of the hot loop's (others run eager)."""

    def __init__(self, forward: Callable, name: str, dynamic: dict[int, tuple[int, ...]],
                 hot: Callable[..., bool] | None = None):
        self.forward = forward  # the class's plain function, (module, *args)
        self.name = name
        self.dynamic = dynamic
        self.hot = hot
        self.failed = False
        self._compiled: Callable | None = None  # made at the first call, inside its fallback
        self._lock = threading.Lock()

    def wrap(self, module: nn.Module) -> None:
        # An instance attribute: nn.Module.__call__ finds it before the class's forward; parameters and the
        # state dict are untouched.
        module.forward = functools.partial(self, module)

    def __call__(self, module: nn.Module, *args):
        if self.failed or (self.hot is not None and not self.hot(*args)):
            return self.forward(module, *args)
        for index, dims in self.dynamic.items():
            _mark_dynamic(args[index], dims)
        try:
            if self._compiled is None:
                self._compiled = torch.compile(self.forward, dynamic=False)
            return self._compiled(module, *args)
        except Exception as exc:  # noqa: BLE001 - any failure of the compiled call is checked against eager
            out = self.forward(module, *args)  # eager raises too when the input is at fault: not compile's
            with self._lock:
                if not self.failed:
                    self.failed = True
                    log.warning("torch.compile of %s failed, running it eager: %s: %s", self.name,
                                type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return out


def _mark_dynamic(arg, dims: tuple[int, ...]) -> None:
    for tensor in arg if isinstance(arg, (list, tuple)) else (arg,):
        if isinstance(tensor, Tensor):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)


def graphs() -> int:
    """Graphs compiled in this process so far (dynamo's count, all modules)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _wrap_all(modules: Iterable[nn.Module], block_type: type, compiled: CompiledForward) -> int:
    count = 0
    for module in modules:
        if type(module) is block_type:
            compiled.wrap(module)
            count += 1
    return count


@functools.cache
def _flow_forwards() -> tuple[CompiledForward, CompiledForward]:
    from .flow_estimator import TransformerBlock
    # x (B, T, C); bias (B, 1, T, T); past (B, M, C) cached normed inputs (models/flow_cache.py).
    return (CompiledForward(TransformerBlock.forward, "the flow estimator's transformer block",
                            {0: (0, 1), 1: (0, 2, 3)}),
            CompiledForward(TransformerBlock.forward_cached, "the flow estimator's cached transformer block",
                            {0: (0, 1), 1: (0, 1), 2: (0, 2, 3)}))


@functools.cache
def _llm_forward() -> CompiledForward:
    from .qwen2 import DecoderLayer
    # Decode steps only (T = 1; a prefill runs once per request): x (B, 1, D); cos, sin (B, 1, hd);
    # mask (B, 1, 1, S'); slots (B,); input_pos (B, 1). Rows and the attended cache length S' vary.
    return CompiledForward(DecoderLayer.forward, "the LLM decoder layer",
                           {0: (0,), 1: (0,), 2: (0,), 3: (0, 3), 4: (0,), 5: (0,)},
                           hot=lambda x, cos, sin, mask, slots, input_pos: slots is not None and x.shape[1] == 1)


@functools.cache
def _hift_forward() -> CompiledForward:
    from .hift import ResBlock
    return CompiledForward(ResBlock.forward, "HiFT's residual block", {0: (0, 2)})  # x (B, C, T)


def compile_flow(flow: nn.Module) -> int:
    """Route the torch flow estimator's transformer blocks through their compiled forwards; returns how many."""
    from .flow_estimator import TransformerBlock
    full, cached = _flow_forwards()
    count = 0
    for module in flow.modules():
        if type(module) is TransformerBlock:
            full.wrap(module)
            module.forward_cached = functools.partial(cached, module)
            count += 1
    return count


def compile_llm(llm: nn.Module) -> int:
    from .llm_precision import multiply_rows_together
    from .qwen2 import DecoderLayer
    for layer in (module for module in llm.modules() if type(module) is DecoderLayer):
        # A compiled layer batches its rows: the rows-apart decode's host reads and loops over rows would
        # recompile it for each row count. Its rows are then equal to their solo runs only up to rounding.
        multiply_rows_together(layer)
        layer.self_attn.rows_apart = False
    return _wrap_all(llm.modules(), DecoderLayer, _llm_forward())


def compile_hift(hift: nn.Module) -> int:
    """Route HiFT's resblocks through their compiled forward; returns how many (0 for CosyVoice3's causal HiFT,
    which runs eager, as its DiT flow does: `compile_flow` finds no UNet block in it)."""
    from .hift import HiFTGenerator, ResBlock
    if not isinstance(hift, HiFTGenerator):
        return 0
    return _wrap_all(hift.modules(), ResBlock, _hift_forward())


@torch.inference_mode()
def warm_up_flow(flow: nn.Module) -> None:
    """The estimator's full pass and one block's cached passes (no cached frames, some): every block shares them."""
    from .flow_estimator import TransformerBlock
    est = flow.decoder.estimator
    weight = est.final_proj.weight
    rows, T, C, mels = 2, WARM_FRAMES, est.config.channels, est.config.out_channels  # 2 rows: guidance
    zeros = functools.partial(torch.zeros, device=weight.device, dtype=weight.dtype)
    with flow.decoder.estimator_arithmetic(weight.device):  # bf16 autocast or none, as the solver calls it
        est(zeros(rows, mels, T), torch.ones_like(zeros(rows, 1, T)), zeros(rows, mels, T), zeros(rows),
            zeros(rows, mels), zeros(rows, mels, T), torch.ones(rows, dtype=torch.bool, device=weight.device))
        block = next(m for m in est.modules() if isinstance(m, TransformerBlock))
        for past in (0, est.config.static_chunk_size):
            block.forward_cached(zeros(rows, T, C), zeros(rows, past, C), zeros(rows, 1, T, past + T))


@torch.inference_mode()
def warm_up_llm(llm: nn.Module) -> None:
    """Decode steps of one row and of two (where the cache has two slots), at position 0 of the first slots:
    a request's prefill rewrites its slot from position 0."""
    from .qwen2 import KV_BUCKET
    device = llm.llm_decoder.weight.device
    for rows in (1, 2)[:max(1, min(2, llm.backbone.max_batch))]:
        zeros = torch.zeros(rows, 1, dtype=torch.long, device=device)
        llm.step_logits(llm.embed_speech(zeros), zeros, torch.arange(rows, device=device),
                        min(KV_BUCKET, llm.max_seq_len))


@torch.inference_mode()
def warm_up_hift(hift: nn.Module) -> None:
    """Vocoder calls of one row and of two (the token2wav scheduler stacks chunks of equal length), short and
    long: torch picks a convolution kernel by length, and each pick is a graph of its own."""
    from .hift_source import ZeroNoise
    device = hift.stft_window.device
    for rows in (1, 2):
        for frames in (WARM_SHORT_FRAMES, WARM_FRAMES):
            hift.inference(torch.zeros(rows, hift.config.in_channels, frames, device=device), None, ZeroNoise())


def _utf8_text_files() -> None:
    """Inductor reads its code templates (UTF-8) with the locale's encoding; Triton's Python stubs may run in
    the C locale, where that is ASCII and the import fails. Only the character type changes, process-wide."""
    if codecs.lookup(locale.getpreferredencoding(False)).name == "utf-8":
        return
    for name in ("C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue


def apply_compile(setting: str, device: torch.device | str, *, llm: nn.Module | None = None,
                  flow: nn.Module | None = None, hift: nn.Module | None = None,
                  warm_up: bool = True) -> tuple[str, ...]:
    """Compile the given modules that `setting` selects on `device` and, with `warm_up`, build their graphs
    now; returns the names compiled. A module that is not a torch module here (an ONNX / TensorRT engine)
    is skipped."""
    given = {"llm": llm, "flow": flow, "hift": hift}
    wanted = [name for name in compiled_modules(setting, device) if isinstance(given[name], nn.Module)]
    if not wanted:
        return ()
    reason = unsupported_reason()
    if reason is not None:
        log.warning("compile %s: running %s eager: %s", setting, ", ".join(wanted), reason)
        return ()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    use_disk_cache()
    _utf8_text_files()
    apply = {"llm": (compile_llm, warm_up_llm), "flow": (compile_flow, warm_up_flow),
             "hift": (compile_hift, warm_up_hift)}
    done = tuple(name for name in wanted if apply[name][0](given[name]) > 0)
    for name in done if warm_up else ():
        apply[name][1](given[name])
    return done
