"""Fill `config.pbtxt` templates and lay out a model repository for one server run.

A template marks each value as `${key}` (key: a Python identifier). Filling is strict both ways: every
placeholder needs a value, every value needs a placeholder, and no `${` may be left over (a typo such as
`${ key}` or `${2x}` is an error, not text). Values are written as they are, with booleans as
`true`/`false`; quoting is the template's business (`string_value: "${model_dir}"`).
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from cosyvoice_triton.errors import TemplateError

CONFIG_NAME = "config.pbtxt"
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SKIP = {"__pycache__", ".pytest_cache"}


def placeholders(text: str) -> set[str]:
    """The keys that `text` asks for."""
    return set(_PLACEHOLDER.findall(text))


def render_template(text: str, values: Mapping[str, object], *, name: str = "template") -> str:
    """`text` with every `${key}` replaced by `values[key]` (see the module docstring for the rules)."""
    wanted = placeholders(text)
    missing = sorted(wanted - values.keys())
    unused = sorted(values.keys() - wanted)
    problems = []
    if missing:
        problems.append(f"no value for {', '.join(missing)}")
    if unused:
        problems.append(f"unknown keys {', '.join(unused)}")
    if problems:
        raise TemplateError(f"{name}: " + "; ".join(problems))
    rendered = _PLACEHOLDER.sub(lambda m: _format(values[m.group(1)], m.group(1), name), text)
    left = rendered.find("${")
    if left >= 0:
        line = rendered.count("\n", 0, left) + 1
        snippet = rendered[left:left + 30].splitlines()[0]
        raise TemplateError(f"{name}: '${{' left over at line {line}: {snippet!r}")
    return rendered


def _format(value: object, key: str, name: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float, os.PathLike)):
        text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
        if "\n" in text or "\r" in text:
            raise TemplateError(f"{name}: value of {key} has a line break")
        return text
    raise TemplateError(f"{name}: value of {key} has type {type(value).__name__}; "
                        "give a str, int, float, bool or path")


def model_names(repo_dir: str | Path) -> list[str]:
    """The models of a repository: its folders holding a `config.pbtxt`, sorted."""
    return sorted(p.parent.name for p in Path(repo_dir).glob(f"*/{CONFIG_NAME}"))


def render_repository(src_repo_dir: str | Path, dst_dir: str | Path,
                      values_per_model: Mapping[str, Mapping[str, object]] | None = None,
                      models: Iterable[str] | None = None, *, link: bool = True,
                      overwrite: bool = False) -> Path:
    """Lay out `models` (default: all) of `src_repo_dir` in `dst_dir` with filled configs.

    `config.pbtxt` is rendered with `values_per_model[model]` (no entry: the template must have no
    placeholders); every other file (`1/model.py`, helpers) is symlinked, or copied when `link` is
    False. Values for a model that is not laid out are an error. An existing model folder in
    `dst_dir` is an error unless `overwrite`. Returns `dst_dir`.
    """
    src = Path(src_repo_dir).resolve()
    dst = Path(dst_dir).resolve()
    values_per_model = dict(values_per_model or {})
    if dst == src or src in dst.parents:
        raise TemplateError(f"destination {dst} lies inside the source repository {src}")
    available = model_names(src)
    chosen = available if models is None else list(models)
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        raise TemplateError(f"{src}: no model folder with {CONFIG_NAME} for {', '.join(unknown)} "
                            f"(have: {', '.join(available) or 'none'})")
    stray = sorted(values_per_model.keys() - set(chosen))
    if stray:
        raise TemplateError(f"values given for models not laid out: {', '.join(stray)}")

    # Render everything first, so that a bad template leaves dst untouched.
    configs = {
        name: render_template((src / name / CONFIG_NAME).read_text(encoding="utf-8"),
                              values_per_model.get(name, {}), name=f"{name}/{CONFIG_NAME}")
        for name in chosen
    }
    dst.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        target = dst / name
        if target.exists() or target.is_symlink():
            if not overwrite:
                raise TemplateError(f"{target} already exists (pass overwrite=True to replace it)")
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        _mirror(src / name, target, link=link)
        (target / CONFIG_NAME).write_text(configs[name], encoding="utf-8")
    return dst


def _mirror(src: Path, dst: Path, *, link: bool) -> None:
    """Recreate `src`'s folders under `dst`; link or copy its files, except the top-level config."""
    dst.mkdir(parents=True)
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP)
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(exist_ok=True)
        for file in sorted(files):
            if rel == Path(".") and file == CONFIG_NAME:
                continue
            source = Path(root) / file
            if link:
                (dst / rel / file).symlink_to(source)
            else:
                shutil.copy2(source, dst / rel / file)
