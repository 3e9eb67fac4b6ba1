"""Every command line says what it does: each subcommand of `cosyvoice-triton` (the tools' ones from the
`cosyvoice_triton.commands` entry points included), of `cosyvoice-client` and of the stand-alone gateway has a
one-line description, and each of their options and positional arguments a help text."""
from __future__ import annotations

import argparse
from importlib.metadata import entry_points

import pytest

import cosyvoice_triton
from cosyvoice_triton.cli import COMMANDS_GROUP, build_parser, main


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from cosyvoice_triton.client.cli import build_parser as client_parser
    from cosyvoice_triton.gateway.__main__ import build_parser as gateway_parser

    return {"cosyvoice-triton": build_parser(), "cosyvoice-client": client_parser(),
            "python -m cosyvoice_triton.gateway": gateway_parser()}


def without_help(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """What under `parser` has no help text: "PATH SUBCOMMAND" for a subcommand, "PATH OPTION" for an option
    or a positional argument (argparse.SUPPRESS, a deliberately hidden flag, counts as help)."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            described = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if not described.get(name):
                    missing.append(f"{path} {name}")
                missing += without_help(sub, f"{path} {name}")
        elif not action.help:
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


@pytest.mark.parametrize("program", list(_parsers()))
def test_every_subcommand_and_option_has_a_help_text(program):
    assert without_help(_parsers()[program], program) == []


def test_the_walk_finds_what_has_no_help():
    """The check itself: an option, a positional and a subcommand without help are each named."""
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--described", help="has one")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--bare")
    sub = parser.add_subparsers()
    plain = sub.add_parser("plain")
    plain.add_argument("path")
    sub.add_parser("fine", help="described")
    assert without_help(parser, "tool") == ["tool --bare", "tool plain", "tool plain path"]


def test_the_top_level_help_lists_every_subcommand_with_a_description(capsys):
    """The tools' subcommands (up, bench, bench-official) are entry points: each is listed, described, as are
    the library's own."""
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    tools = {entry.name for entry in entry_points(group=COMMANDS_GROUP)}
    assert {"up", "bench", "bench-official"} <= tools
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    described = {choice.dest: choice.help for choice in subcommands._choices_actions}
    for name in {"export", "synth", "serve", "finetune", "voices", *tools}:
        assert described.get(name) and f"    {name} " in text, (name, text)
    description = build_parser().description
    assert all(name in description for name in ("up", "serve", "bench", "bench-official")), description


def test_a_client_only_install_says_which_extra_the_commands_need(monkeypatch, capsys):
    """Without the server's packages (torch, ...), `cosyvoice-triton` names the `serve` extra instead of a
    traceback, and `--version` still answers (tests/test_client_install.py runs it in a real client install)."""
    import cosyvoice_triton.cli as cli

    def build_without_torch():
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(cli, "build_parser", build_without_torch)
    assert cli.main(["serve"]) == 2
    assert "(torch is not installed): pip install 'cosyvoice-triton[serve]'" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"cosyvoice-triton {cosyvoice_triton.__version__}"
