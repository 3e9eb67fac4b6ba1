"""`python -m cosyvoice_triton.training ...`: the `finetune` command, for torchrun:

    torchrun --nproc_per_node 8 -m cosyvoice_triton.training --data DIR --model-dir BASE --out NEW
"""
from __future__ import annotations

import argparse
import sys

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.training.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyvoice_triton.training",
                                     description="fine-tune CosyVoice2 or CosyVoice3 on recordings (see `cosyvoice-triton finetune`)")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except CosyVoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
