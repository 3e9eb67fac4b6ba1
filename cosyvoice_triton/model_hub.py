"""Resolve `--model-dir`: a local folder, or a ModelScope / Hugging Face model id to download."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from .errors import ModelFolderError

_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_dir(spec: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Return a local folder for `spec`, downloading a hub model id when a hub client is installed."""
    path = Path(spec).expanduser()
    if path.exists():
        return path.resolve()
    text = str(spec)
    if not _MODEL_ID.match(text):
        raise ModelFolderError(f"model folder {text!r} does not exist (and is not a hub model id like 'org/name')")
    errors = []
    for name, download in (("modelscope", _from_modelscope), ("huggingface_hub", _from_huggingface)):
        if importlib.util.find_spec(name) is None:
            errors.append(f"{name} is not installed")
            continue
        try:
            return Path(download(text, cache_dir))
        except Exception as exc:  # network and hub errors vary by client version
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    raise ModelFolderError(
        f"cannot download model {text!r}: " + "; ".join(errors)
        + ". Download it on a machine with network access and pass the folder, or `pip install -e .[hub]`.")


def _from_modelscope(model_id: str, cache_dir) -> str:
    from modelscope import snapshot_download
    return snapshot_download(model_id, cache_dir=str(cache_dir) if cache_dir else None)


def _from_huggingface(model_id: str, cache_dir) -> str:
    from huggingface_hub import snapshot_download
    return snapshot_download(model_id, cache_dir=str(cache_dir) if cache_dir else None)
