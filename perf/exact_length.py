"""Exactly N speech tokens per LLM stream: the benchmarks' way to time equal work with the official code.

The serving code has no such knob. The benchmark makes the LLM itself exact-length (`exact_length`: on
that one `SpeechLM` instance, the stop tokens' logits are -inf at every step and the length limits are
(N, N), so a stream ends after N tokens, or earlier if the KV cache is full), and the real decoding
paths run on it unchanged: `generate`, the in-process pipeline (`CosyVoice2`) and the served `LLMScheduler`.
perf/official_driver.py patches the official `Qwen2LM` in the same way.

For a server, this module renders the run's own templates (`exact_length_templates`): a copy of
`model_repository/` in which `llm/1/model.py` is perf/_exact_length_llm.py, the served model file sits
beside it as `served_model.py`, and `llm/config.pbtxt` gets the parameter `exact_speech_tokens`. The
overlay runs the served model as it is and then makes its scheduler's LLM exact-length. Start such a
server with every `serve` flag:

    python -m cosyvoice_triton.perf.exact_length --exact-speech-tokens 250 --model-dir DIR [serve flags]
    cosyvoice-triton bench-official --model-dir DIR --speech-tokens 250 --triton localhost:8001 --json

Bistream streams (text fed as it comes) do not fit this: their fill token is a stop token.
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from cosyvoice_triton.cli import add_serve_arguments, serve_options_from_args
from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.server.launcher import ServeOptions, new_run_dir, serve

if TYPE_CHECKING:
    from torch import Tensor

    from cosyvoice_triton.models.speech_lm import SpeechLM

PARAMETER = "exact_speech_tokens"  # the llm config.pbtxt parameter the overlay reads (and takes out)
OVERLAY = Path(__file__).resolve().with_name("_exact_length_llm.py")  # the overlay's llm/1/model.py
SERVED_MODEL = "served_model.py"  # the served llm/1/model.py, beside the overlay


def exact_length(llm: SpeechLM, n: int) -> SpeechLM:
    """Make `llm` (this instance, on its final device) decode exactly `n` speech tokens per stream; returns it."""
    import torch  # here: starting a server through this module needs no torch in this process

    if n < 1:
        raise ValueError(f"exact length must be >= 1, got {n}")
    served_step_logits = llm.step_logits
    stop = torch.tensor(llm.config.stop_tokens, device=llm.llm_decoder.weight.device)  # where logits are made

    def step_logits(x: Tensor, input_pos: Tensor, slots: Tensor, kv_len: int | None = None) -> Tensor:
        """`SpeechLM.step_logits` (B, V) with the stop tokens' columns at -inf."""
        return served_step_logits(x, input_pos, slots, kv_len).index_fill(-1, stop, -math.inf)

    llm.step_logits = step_logits  # on the instance: the class and other instances stay as served
    llm.length_limits = lambda text_len: (n, n)
    return llm


def exact_length_templates(templates: Path, dst: Path, n: int) -> Path:
    """A copy of the model templates `templates` in `dst` whose `llm` is the exact-length overlay; returns dst."""
    if n < 1:
        raise ValueError(f"exact length must be >= 1, got {n}")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(templates, dst, ignore=shutil.ignore_patterns("__pycache__"))
    version = dst / "llm" / "1"
    (version / "model.py").rename(version / SERVED_MODEL)
    shutil.copyfile(OVERLAY, version / "model.py")
    config = dst / "llm" / "config.pbtxt"
    config.write_text(config.read_text() + f"# Rendered by perf/exact_length.py: every stream exactly {n} speech "
                                           f"tokens (perf/_exact_length_llm.py reads it).\n"
                                           f'parameters {{ key: "{PARAMETER}" value: {{ string_value: "{n}" }} }}\n')
    return dst


def exact_length_options(options: ServeOptions, n: int) -> ServeOptions:
    """`options` for a server whose LLM streams are exactly `n` tokens: the run folder (made now unless
    given) holds the overlay's templates, in `templates/`."""
    run_dir = Path(options.run_dir) if options.run_dir else new_run_dir()
    templates = exact_length_templates(Path(options.repository), run_dir / "templates", n)
    return replace(options, run_dir=run_dir, repository=templates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyvoice_triton.perf.exact_length",
                                     description="`cosyvoice-triton serve` with exactly N speech tokens per LLM "
                                                 "stream (benchmarks only: bench-official --triton)")
    parser.add_argument("--exact-speech-tokens", type=int, required=True, metavar="N",
                        help="every LLM stream decodes exactly N speech tokens, stop tokens masked")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve(exact_length_options(serve_options_from_args(args), args.exact_speech_tokens))
    except CosyVoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
