"""Resolve `--model-dir`: a local folder, or a ModelScope / Hugging Face model id to download; and the
default model when none is named (`default_model`)."""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
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


# ---- the default model: what `up` / `serve` serve without --model-dir --------------------------------------

MODELSCOPE_ID = "iic/CosyVoice2-0.5B"  # the released folder on ModelScope
HUGGINGFACE_ID = "FunAudioLLM/CosyVoice2-0.5B"  # and on Hugging Face


@dataclass(frozen=True)
class DefaultModel:
    """The model folder chosen when none is named (None: only the tiny random folder is left), and how."""
    path: Path | None
    source: str  # "COSYVOICE_MODEL_DIR", "ModelScope cache", "Hugging Face cache", "downloaded", "random"


def cached_released_folders() -> list[tuple[str, Path]]:
    """(source, folder) of the released CosyVoice2-0.5B in the hub caches, ModelScope first."""
    home = Path.home()
    modelscope = Path(os.environ.get("MODELSCOPE_CACHE", home / ".cache" / "modelscope" / "hub"))
    hf_home = Path(os.environ.get("HF_HOME", home / ".cache" / "huggingface"))
    hf_hub = Path(os.environ.get("HF_HUB_CACHE", hf_home / "hub"))
    found = [("ModelScope cache", modelscope / MODELSCOPE_ID),
             ("ModelScope cache", modelscope / "models" / MODELSCOPE_ID)]  # newer modelscope clients
    snapshots = hf_hub / f"models--{HUGGINGFACE_ID.replace('/', '--')}" / "snapshots"
    if snapshots.is_dir():
        found += [("Hugging Face cache", p) for p in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime,
                                                              reverse=True)]
    return [(source, path) for source, path in found if (path / "cosyvoice2.yaml").is_file()]


def default_model(download: bool = True, log=print) -> DefaultModel:
    """`$COSYVOICE_MODEL_DIR`, else the released CosyVoice2-0.5B from the hub caches, else downloaded
    (when `download` and a hub client is installed and reachable: its progress bar, resumable), else
    DefaultModel(None, "random"): the caller makes the tiny random folder and says it speaks noise."""
    named = os.environ.get("COSYVOICE_MODEL_DIR")
    if named:
        return DefaultModel(resolve_model_dir(named), "COSYVOICE_MODEL_DIR")
    cached = cached_released_folders()
    if cached:
        source, path = cached[0]
        return DefaultModel(path, source)
    if download:
        for name, fetch, model_id in (("modelscope", _from_modelscope, MODELSCOPE_ID),
                                      ("huggingface_hub", _from_huggingface, HUGGINGFACE_ID)):
            if importlib.util.find_spec(name) is None:
                continue
            log(f"model: downloading {model_id} with {name} (resumable: run again to continue) ...")
            try:
                return DefaultModel(Path(fetch(model_id, None)), "downloaded")
            except Exception as exc:  # noqa: BLE001 - offline, or the hub refused: the next one, then random
                log(f"model: {name} could not download {model_id}: {type(exc).__name__}: {exc}")
    return DefaultModel(None, "random")
