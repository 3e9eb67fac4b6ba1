"""The library's layers import one way: base → models → engines → preprocess → runtime → triton → server → cli.

The rule this test encodes, read from the source with `ast` (nothing imported; every `import` and
`from ... import`, relative ones resolved, those under `if TYPE_CHECKING:` included):

- a module of `cosyvoice_triton` belongs to the layer of its first package (`cosyvoice_triton.runtime.x`
  is in `runtime`); `cosyvoice_triton/cli.py` is the `cli` layer; every other top-level module
  (`config`, `errors`, `messages`, `targets`, `model_hub`, `audio_out`, ...) is `base`, the lowest layer;
- a package that is none of the named layers sits where `PLACED` puts it (a new package fails the test
  until it is placed there);
- a module may import its own layer and the layers before it, never a later one.

The tool folders (client/, gateway/, perf/, mapped into the namespace) are not layers of the library:
that the library never imports them is tests/test_architecture.py's check.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "cosyvoice_triton"
LAYERS = ("base", "models", "engines", "preprocess", "runtime", "triton", "server", "cli")
PLACED = {  # library packages outside the named layers, at the layer whose imports they may make
    "random_folder": "runtime",  # writes random model folders from models + preprocess; serve uses it
    "training": "runtime",  # fine-tuning data and losses over models + preprocess; a command uses it
}
TOOLS = ("client", "gateway", "perf", "export")


def layer_of(module: str) -> str | None:
    """The layer of a `cosyvoice_triton...` module name; None for the tool folders."""
    parts = module.split(".")[1:]
    if not parts:
        return "base"
    if parts[0] in TOOLS:
        return None
    if parts[0] in LAYERS:
        return parts[0]
    if parts[0] in PLACED:
        return PLACED[parts[0]]
    is_package = (LIBRARY / parts[0]).is_dir()
    assert not is_package, f"package cosyvoice_triton.{parts[0]} has no layer: place it in PLACED"
    return "base"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(LIBRARY).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["cosyvoice_triton", *parts])


def library_imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every `cosyvoice_triton` module that `path` imports."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            # `from cosyvoice_triton import runtime` names the package runtime, not base
            found += [(node.lineno, f"{name}.{alias.name}" if name == "cosyvoice_triton" else name)
                      for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "cosyvoice_triton"]


def upward_imports(path: Path) -> list[str]:
    mine = layer_of(module_name(path))
    problems = []
    for line, name in library_imports(path):
        theirs = layer_of(name)
        if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
            problems.append(f"{path.relative_to(LIBRARY.parent)}:{line} ({mine}) imports {name} ({theirs})")
    return problems


def test_the_scan_resolves_relative_imports_and_finds_an_upward_arrow(tmp_path, monkeypatch):
    """The checker itself: a models module importing runtime (relative or absolute) is caught."""
    library = tmp_path / "cosyvoice_triton"
    (library / "models").mkdir(parents=True)
    source = library / "models" / "bad.py"
    source.write_text("from ..runtime.sampling import draw\n"
                      "from cosyvoice_triton import triton\n"
                      "from ..errors import InvalidInput\n"
                      "from .qwen2 import Qwen2Config\n"
                      "import numpy\n")
    monkeypatch.setattr(sys.modules[__name__], "LIBRARY", library)
    assert library_imports(source) == [(1, "cosyvoice_triton.runtime.sampling"), (2, "cosyvoice_triton.triton"),
                                       (3, "cosyvoice_triton.errors"), (4, "cosyvoice_triton.models.qwen2")]
    assert [problem.split(" imports ")[1] for problem in upward_imports(source)] == [
        "cosyvoice_triton.runtime.sampling (runtime)", "cosyvoice_triton.triton (triton)"]


def test_every_library_module_imports_only_its_own_layer_and_those_before_it():
    sources = sorted(LIBRARY.rglob("*.py"))
    assert len(sources) > 50  # the whole library was read
    problems = [problem for path in sources for problem in upward_imports(path)]
    assert problems == []
