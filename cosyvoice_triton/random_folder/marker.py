"""A random folder says so: a `RANDOM_WEIGHTS` file beside the weights, read by what serves it (the
banner of `up`, the gateway's /readyz and web page), so nobody takes its noise for the model's voice."""
from __future__ import annotations

from pathlib import Path

MARKER = "RANDOM_WEIGHTS"
NOTE = "random weights: it speaks noise; point --model-dir at the released folder"


def mark_random(folder: str | Path) -> None:
    (Path(folder) / MARKER).write_text(NOTE + "\n")


def is_random(folder: str | Path | None) -> bool:
    return folder is not None and (Path(folder) / MARKER).is_file()
