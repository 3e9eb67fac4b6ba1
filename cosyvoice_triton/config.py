"""Read the released `cosyvoice2.yaml` / `cosyvoice3.yaml` without executing it.

The official yaml is written for hyperpyyaml: `!new:pkg.Class` builds objects, `!ref <key>` points at
other keys and `!apply:fn` calls functions. We never instantiate anything named in a config file; we
only read the hyperparameters. Tagged mappings become plain dicts with the tag kept under `"__tag__"`,
`!ref` expressions are resolved (they may do arithmetic, e.g. `!ref <chunk_size> * <token_mel_ratio>`),
and `!apply` / `!name` nodes are kept as inert dicts.
"""
from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cosyvoice_triton.errors import ModelFolderError
from cosyvoice_triton.family import FAMILIES, ModelFamily, family_of

TAG_KEY = "__tag__"


@dataclass(frozen=True)
class _Ref:
    expr: str  # e.g. "<chunk_size> * <token_mel_ratio>"


class _Loader(yaml.SafeLoader):
    """SafeLoader that turns every `!tag` into data instead of refusing or executing it."""


def _construct_tagged(loader: _Loader, tag_suffix: str, node: yaml.Node) -> Any:
    tag = "!" + tag_suffix
    if tag == "!ref":
        return _Ref(loader.construct_scalar(node))
    if isinstance(node, yaml.MappingNode):
        value = loader.construct_mapping(node, deep=True)
        return {TAG_KEY: tag, **value}
    if isinstance(node, yaml.SequenceNode):
        return {TAG_KEY: tag, "args": loader.construct_sequence(node, deep=True)}
    scalar = loader.construct_scalar(node)
    return {TAG_KEY: tag} if scalar in ("", None) else {TAG_KEY: tag, "value": scalar}


_Loader.add_multi_constructor("!", _construct_tagged)

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}


def _eval_arith(node: ast.AST) -> Any:
    """Evaluate a literal arithmetic expression: numbers, + - * / //, unary minus. Nothing else."""
    if isinstance(node, ast.Expression):
        return _eval_arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_arith(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_arith(node.left), _eval_arith(node.right))
    raise ValueError(f"unsupported expression in !ref: {ast.dump(node)}")


def _resolve(value: Any, root: dict) -> Any:
    if isinstance(value, _Ref):
        names = re.findall(r"<([^<>]+)>", value.expr)
        if value.expr.strip() == f"<{names[0]}>" and len(names) == 1:
            return _resolve(_lookup(root, names[0]), root)
        expr = value.expr
        for name in names:
            expr = expr.replace(f"<{name}>", repr(_resolve(_lookup(root, name), root)))
        return _eval_arith(ast.parse(expr, mode="eval"))
    if isinstance(value, dict):
        return {k: _resolve(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, root) for v in value]
    return value


def _lookup(root: dict, dotted: str) -> Any:
    node: Any = root
    for part in dotted.split("."):
        node = node[part]
    return node


def read_yaml(path: str | Path) -> dict:
    """Parse a hyperpyyaml file into plain data (see module docstring)."""
    raw = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Loader)
    return _resolve(raw, raw)


def read_qwen_config(model_dir: str | Path) -> dict:
    """The Qwen2 backbone's `config.json` from `CosyVoice-BlankEN/`."""
    return json.loads((Path(model_dir) / "CosyVoice-BlankEN" / "config.json").read_text())


# Files the released folders carry that no model here loads (glob pattern, why).
UNUSED_FILES = (
    ("llm.rl.pt", "the official API loads llm.pt, as this stack does; llm.rl.pt is the LM after reinforcement "
                  "learning, which the official code does not load either"),
    ("flow.decoder.estimator.*.onnx", "the graph engines export the estimator from flow.pt themselves, so the "
                                      "graph always has the weights that torch loads"),
    ("*.zip", "TorchScript exports of the official runtime; the modules run from the .pt weights"),
    ("*.plan", "TensorRT plans of the official runtime, built for another GPU and version; --engine tensorrt "
               "builds its own"),
)


@dataclass(frozen=True)
class ModelPaths:
    """The files of a released model folder; the yaml it holds names its family (`family.family_of`)."""

    root: Path

    @property
    def family(self) -> ModelFamily:
        return family_of(self.root)

    @property
    def yaml(self) -> Path:
        return self.root / self.family.yaml_file

    @property
    def llm(self) -> Path:
        return self.root / "llm.pt"

    @property
    def flow(self) -> Path:
        return self.root / "flow.pt"

    @property
    def hift(self) -> Path:
        return self.root / "hift.pt"

    @property
    def campplus(self) -> Path:
        return self.root / "campplus.onnx"

    @property
    def speech_tokenizer(self) -> Path:
        return self.root / self.family.speech_tokenizer_file

    @property
    def qwen_dir(self) -> Path:
        return self.root / "CosyVoice-BlankEN"

    def unused(self) -> list[str]:
        """What the folder holds beside its released layout that this stack does not load, each with why: the
        released folders carry extras (`UNUSED_FILES`); a line each is logged when the folder is loaded."""
        return [f"{path.name}: not used ({why})" for pattern, why in UNUSED_FILES
                for path in sorted(self.root.glob(pattern))]

    def missing(self) -> list[str]:
        """The files the folder lacks (relative names). Without a family yaml, a family's own file is named as
        the alternatives ("cosyvoice2.yaml or cosyvoice3.yaml")."""
        try:
            family = [self.family]
        except ModelFolderError:
            family = list(FAMILIES)
        names = [[f.yaml_file for f in family], ["llm.pt"], ["flow.pt"], ["hift.pt"], ["campplus.onnx"],
                 [f.speech_tokenizer_file for f in family], ["CosyVoice-BlankEN/config.json"]]
        return [" or ".join(alternatives) for alternatives in names
                if not any((self.root / name).exists() for name in alternatives)]
