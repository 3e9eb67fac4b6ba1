"""Dependencies point one way: the tool folders (client/, gateway/, perf/) import the library, never the
reverse, and the Triton model files import only the library.

Read from the source with `ast`, nothing imported: every `import` / `from ... import` (absolute or
relative, resolved against the file's own package) and every `importlib.import_module("...")` /
`__import__("...")` with a literal name.

Inside the library, the layers import one way: base → wire → models → engines → preprocess →
{llm, token2wav, voices} → pipeline → triton → server → cli. The wire package is what the gateway, the client SDK and
the Triton models share: it imports only the base modules (never torch, never a model floor), and the gateway and
the client import it, never `cosyvoice_triton.triton` (what only the Triton models import). The three stage rooms (llm, token2wav, voices) share a floor and never import
each other; no module of the library takes part in an import circle.

The rule this test encodes, read from the source with `ast` (nothing imported; every `import` and
`from ... import`, relative ones resolved, those under `if TYPE_CHECKING:` included):

- a module of `cosyvoice_triton` belongs to the layer of its first package (`cosyvoice_triton.llm.x`
  is in `llm`); `cosyvoice_triton/cli.py` is the `cli` layer; every other top-level module
  (`config`, `errors`, `messages`, `targets`, `model_hub`, `audio_out`, ...) is `base`, the lowest layer;
- a package that is none of the named layers sits where `PLACED` puts it (a new package fails the test
  until it is placed there);
- a module may import its own layer and the layers of lower floors, never a later floor nor another room of its
  own floor.

The tool folders (client/, gateway/, perf/, mapped into the namespace) are not layers of the library:
the checks above keep the library from importing them.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LIBRARY = REPO_ROOT / "cosyvoice_triton"
TOOLS = ("client", "gateway", "perf", "export")  # export/: the folder that was; it must not come back
TOOL_PACKAGES = tuple(f"cosyvoice_triton.{name}" for name in TOOLS)
TOOL_FOLDERS = {"client": REPO_ROOT / "client", "gateway": REPO_ROOT / "gateway", "perf": REPO_ROOT / "perf"}


def module_name(path: Path, root: Path, package: str) -> str:
    """`root/a/b.py` -> "package.a.b"; `root/a/__init__.py` -> "package.a"."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def imported_names(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of everything `path` (the module `module`) imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve_relative(module, is_package, node.module, node.level)
            names.append((node.lineno, base))
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]  # `from pkg import sub`
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.append((node.lineno, first.value))
    return names


def resolve_relative(module: str, is_package: bool, name: str | None, level: int) -> str:
    if level == 0:
        return name or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, *([name] if name else [])])


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def names_a_tool(name: str) -> bool:
    return any(name == tool or name.startswith(tool + ".") for tool in TOOL_PACKAGES + TOOLS)


def test_the_import_scan_sees_every_form(tmp_path):
    """The checker itself: each way of naming a tool folder is caught, library imports are not."""
    package = tmp_path / "cosyvoice_triton" / "server"
    package.mkdir(parents=True)
    source = package / "bad.py"
    source.write_text("import cosyvoice_triton.gateway.app\n"
                      "from cosyvoice_triton.perf import bench\n"
                      "from ..client.common import read_wav\n"
                      "from .. import export\n"
                      "import importlib\n"
                      "importlib.import_module('cosyvoice_triton.gateway.config')\n"
                      "from ..pipeline import seeds\n"
                      "from .launcher import serve\n")
    found = {name for _, name in imported_names(source, "cosyvoice_triton.server.bad") if names_a_tool(name)}
    assert found == {"cosyvoice_triton.gateway.app", "cosyvoice_triton.perf", "cosyvoice_triton.perf.bench",
                     "cosyvoice_triton.client.common", "cosyvoice_triton.client.common.read_wav",
                     "cosyvoice_triton.export", "cosyvoice_triton.gateway.config"}


def test_the_library_never_imports_a_tool_folder():
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        module = module_name(path, LIBRARY, "cosyvoice_triton")
        offenders += [f"{path.relative_to(REPO_ROOT)}:{line} imports {name}"
                      for line, name in imported_names(path, module) if names_a_tool(name)]
    assert not offenders, "the library imports a tool folder:\n" + "\n".join(offenders)


def test_model_files_never_import_a_tool_folder():
    model_files = sorted((REPO_ROOT / "model_repository").glob("*/1/model.py"))
    assert len(model_files) >= 6, model_files
    offenders = []
    for path in model_files:
        offenders += [f"{path.relative_to(REPO_ROOT)}:{line} imports {name}"
                      for line, name in imported_names(path, "model") if names_a_tool(name)]
    assert not offenders, "a model.py imports a tool folder:\n" + "\n".join(offenders)


def test_the_gateway_and_the_client_never_import_the_triton_package():
    """What they share with the Triton models is the wire package; `cosyvoice_triton.triton` is what only the
    model files import."""
    offenders = []
    for folder in ("gateway", "client"):
        root = TOOL_FOLDERS[folder]
        for path in sorted(root.rglob("*.py")):
            module = module_name(path, root, f"cosyvoice_triton.{folder}")
            offenders += [f"{path.relative_to(REPO_ROOT)}:{line} imports {name}"
                          for line, name in imported_names(path, module)
                          if name == "cosyvoice_triton.triton" or name.startswith("cosyvoice_triton.triton.")]
    assert not offenders, "a tool imports the Triton models' package:\n" + "\n".join(offenders)


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of what `path` imports when it runs: its imports outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for statement in block.body for node in ast.walk(statement)}
    module = library_module_name(path)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, resolve_relative(module, is_package, node.module, node.level)))
    return found


def test_the_wire_package_imports_only_the_base_modules_and_never_torch():
    """The client SDK installs without torch or the model floors, and imports the wire package: the wire modules
    import base modules and each other only, and neither they nor the base modules they reach import torch."""
    wire = sorted((LIBRARY / "wire").glob("*.py"))
    assert len(wire) >= 5, wire
    problems, reached, todo = [], set(), list(wire)
    while todo:
        path = todo.pop()
        if path in reached:
            continue
        reached.add(path)
        for line, name in runtime_imports(path):
            where = f"{path.relative_to(REPO_ROOT)}:{line} imports {name}"
            if name.split(".")[0] == "torch":
                problems.append(where)
            elif name.split(".")[0] == "cosyvoice_triton" and name != "cosyvoice_triton":
                if layer_of(name) not in ("base", "wire"):
                    problems.append(f"{where} ({layer_of(name)})")
                else:
                    todo += [file for file in (LIBRARY.parent / (name.replace(".", "/") + ".py"),
                                               LIBRARY.parent / name.replace(".", "/") / "__init__.py")
                             if file.exists()]
    assert problems == []


def test_tool_folders_import_the_library_by_absolute_name():
    """`from cosyvoice_triton.models.flow import ...`, never `from ..models...`: `..` of a tool folder is
    the repository root on disk, a package only through pyproject's package-dir mapping. (A tool's own
    siblings may be named relatively, `from .config import ...`.)"""
    offenders = []
    for folder, root in TOOL_FOLDERS.items():
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            depth = len(path.relative_to(root).parts)  # `.` .. this many dots stay inside the folder
            offenders += [f"{path.relative_to(REPO_ROOT)}:{node.lineno} from {'.' * node.level}{node.module or ''}"
                          for node in ast.walk(tree)
                          if isinstance(node, ast.ImportFrom) and node.level > depth]
    assert not offenders, "relative import out of a tool folder:\n" + "\n".join(offenders)


# ---- the library's own layers ----------------------------------------------------------------------
FLOORS = (("base",), ("wire",), ("models",), ("engines",), ("preprocess",), ("llm", "token2wav", "voices"), ("pipeline",),
          ("triton",), ("server",), ("cli",))
LAYERS = tuple(room for floor in FLOORS for room in floor)
FLOOR_OF = {room: index for index, floor in enumerate(FLOORS) for room in floor}
PLACED = {  # library packages outside the named layers, at the layer whose imports they may make
    "random_folder": "pipeline",  # writes random model folders from models + preprocess; serve uses it
    "training": "pipeline",  # fine-tuning data and losses over models + preprocess; a command uses it
}


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


def library_module_name(path: Path) -> str:
    parts = list(path.relative_to(LIBRARY).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["cosyvoice_triton", *parts])


def library_imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every `cosyvoice_triton` module that `path` imports."""
    module = library_module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            # `from cosyvoice_triton import llm` names the package llm, not base
            found += [(node.lineno, f"{name}.{alias.name}" if name == "cosyvoice_triton" else name)
                      for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "cosyvoice_triton"]


def upward_imports(path: Path) -> list[str]:
    mine = layer_of(library_module_name(path))
    problems = []
    for line, name in library_imports(path):
        theirs = layer_of(name)
        above = theirs is not None and FLOOR_OF[theirs] > FLOOR_OF[mine]
        beside = theirs is not None and FLOOR_OF[theirs] == FLOOR_OF[mine] and theirs != mine
        if above or beside:
            problems.append(f"{path.relative_to(LIBRARY.parent)}:{line} ({mine}) imports {name} ({theirs})")
    return problems


def test_the_scan_resolves_relative_imports_and_finds_an_upward_arrow(tmp_path, monkeypatch):
    """The checker itself: a models module importing a later floor (relative or absolute) is caught."""
    library = tmp_path / "cosyvoice_triton"
    (library / "models").mkdir(parents=True)
    source = library / "models" / "bad.py"
    source.write_text("from ..llm.sampling import draw\n"
                      "from cosyvoice_triton import triton\n"
                      "from ..errors import InvalidInput\n"
                      "from .qwen2 import Qwen2Config\n"
                      "import numpy\n")
    monkeypatch.setattr(sys.modules[__name__], "LIBRARY", library)
    assert library_imports(source) == [(1, "cosyvoice_triton.llm.sampling"), (2, "cosyvoice_triton.triton"),
                                       (3, "cosyvoice_triton.errors"), (4, "cosyvoice_triton.models.qwen2")]
    assert [problem.split(" imports ")[1] for problem in upward_imports(source)] == [
        "cosyvoice_triton.llm.sampling (llm)", "cosyvoice_triton.triton (triton)"]


def test_every_library_module_imports_only_its_own_layer_and_those_before_it():
    sources = sorted(LIBRARY.rglob("*.py"))
    assert len(sources) > 50  # the whole library was read
    problems = [problem for path in sources for problem in upward_imports(path)]
    assert problems == []


def test_rooms_of_one_floor_never_import_each_other(tmp_path, monkeypatch):
    """The checker itself: token2wav importing llm (same floor, another room) is caught; its own room is not."""
    library = tmp_path / "cosyvoice_triton"
    (library / "token2wav").mkdir(parents=True)
    source = library / "token2wav" / "bad.py"
    source.write_text("from ..llm.scheduler import LLMScheduler\nfrom .stream import Token2Wav\n")
    monkeypatch.setattr(sys.modules[__name__], "LIBRARY", library)
    assert [problem.split(" imports ")[1] for problem in upward_imports(source)] == [
        "cosyvoice_triton.llm.scheduler (llm)"]


def import_graph(modules: dict[str, Path], imports_of) -> dict[str, set[str]]:
    """Each of `modules` (name -> file) -> the ones among them it imports (`imports_of(module, path)` gives the
    imported names; a `from pkg import name` counts as importing `pkg.name` when that is a module, else `pkg`)."""
    graph = {}
    for module, path in modules.items():
        targets = set()
        for _, name in imports_of(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def module_graph() -> dict[str, set[str]]:
    """Every library module -> the library modules it imports."""
    modules = {library_module_name(path): path for path in LIBRARY.rglob("*.py")}
    return import_graph(modules, lambda module, path: library_imports(path))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_library_has_no_import_circles():
    """Lazy imports inside functions count too: a circle hidden in a function is still a circle."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    assert circles(module_graph()) == []


def tool_module_graph(folder: str) -> dict[str, set[str]]:
    """The modules of one tool folder (as `cosyvoice_triton.<folder>.x`) -> the modules of that folder they import."""
    root, package = TOOL_FOLDERS[folder], f"cosyvoice_triton.{folder}"
    modules = {module_name(path, root, package): path for path in root.rglob("*.py")}
    return import_graph(modules, lambda module, path: imported_names(path, module))


def test_the_tool_folders_have_no_import_circles():
    """gateway/, client/ and perf/ as well: a module that needs another's names imports it, never both ways
    (the gateway's serve loop lives in serving.py, not in drain.py, which state.py imports)."""
    assert {folder: circles(tool_module_graph(folder)) for folder in TOOL_FOLDERS} == {
        folder: [] for folder in TOOL_FOLDERS}


# ---- tensor names are spelled in cosyvoice_triton/wire/names.py only (and the config.pbtxt files) ----

MODEL_REPOSITORY = REPO_ROOT / "model_repository"
NAMES_PAGE = LIBRARY / "wire" / "names.py"
# The code that speaks in tensors: it names them by the constants of wire/names.py.
TENSOR_USERS = sorted([*(LIBRARY / "wire").glob("*.py"), *(LIBRARY / "triton").glob("*.py"),
                       *MODEL_REPOSITORY.glob("*/1/model.py"), LIBRARY / "server" / "liveness.py",
                       *(REPO_ROOT / "gateway").glob("triton_*.py"), REPO_ROOT / "gateway" / "routes_kserve.py",
                       REPO_ROOT / "client" / "triton_client.py"])
# Strings there that equal a tensor name without naming a tensor: (file, string) -> why.
NOT_TENSOR_NAMES = {
    ("cosyvoice_triton/triton/metrics.py", "finalize"): "a label of the freed-streams metric: its final chunk",
    ("cosyvoice_triton/triton/metrics.py", "cancel"): "a label of the freed-streams metric: cancelled",
    ("gateway/routes_kserve.py", "name"): "a key of a KServe JSON tensor",
    ("client/triton_client.py", "voice_id"): "the SDK's argument, named in its own errors",
}


def tensor_names() -> set[str]:
    """Every input and output name in the config.pbtxt files (`name: "..."`, less the models' own names)."""
    names = set()
    for config in MODEL_REPOSITORY.glob("*/config.pbtxt"):
        names |= set(re.findall(r'(?<!\w)name:\s*"(\w+)"', config.read_text()))
    return names - {config.parent.name for config in MODEL_REPOSITORY.glob("*/config.pbtxt")}


def name_literals(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, string) of every string literal in `source` that is one of `names`; docstrings do not count."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                  and id(node) not in docstrings)


def test_the_name_finder_finds_names_but_not_docstrings():
    source = '"""waveform"""\ndef f():\n    """waveform"""\n    return {"waveform": x, "other": "stream_id"}\n'
    assert name_literals(source, {"waveform", "stream_id"}) == [(4, "stream_id"), (4, "waveform")]
    assert {"waveform", "speech_tokens", "stream_id", "reference_wav"} <= tensor_names()
    assert "cosyvoice2" not in tensor_names() and "llm" not in tensor_names()


def test_tensor_names_are_spelled_only_in_the_names_page():
    """A model's tensors are named on one page (wire/names.py: constants); a literal elsewhere is a second
    spelling that a renamed tensor leaves behind."""
    names = tensor_names()
    found = [f"{path.relative_to(REPO_ROOT)}:{line}: {value!r}"
             for path in TENSOR_USERS if path != NAMES_PAGE
             for line, value in name_literals(path.read_text(), names)
             if (path.relative_to(REPO_ROOT).as_posix(), value) not in NOT_TENSOR_NAMES]
    assert found == []
