"""`moekit --version`, `-h` everywhere, and help texts printed whole (rich markup swallows `[word]`)."""

from __future__ import annotations

import re

import pytest
import typer

from cli_runner import moekit
from moekit import __version__


def _commands() -> list[tuple]:
    """Every command of the CLI, as (path of names, click command), subgroups walked."""
    from moekit import cli

    cli._register()
    root = typer.main.get_command(cli.app)
    out, todo = [], [((), root)]
    while todo:
        path, cmd = todo.pop()
        out.append((path, cmd))
        if hasattr(cmd, "commands"):  # a group (typer vendors its own click: no isinstance)
            todo += [((*path, name), sub) for name, sub in cmd.commands.items()]
    return sorted(out, key=lambda pc: pc[0])


COMMANDS = _commands()
BRACKETED = re.compile(r"\\?\[([^\[\]\s]+)\]")


def _bracketed(text: str | None) -> list[str]:
    """`[model]` or `\\[model]` as the user should read them: `[model]`."""
    return [f"[{m}]" for m in BRACKETED.findall(text or "")]


def test_version(capsys):
    code, out, err = moekit(capsys, "--version")
    assert code == 0 and out.strip() == f"moekit {__version__}" and err == ""


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "moekit")
def test_dash_h_is_help(capsys, path):
    code, out, err = moekit(capsys, *path, "-h")
    assert code == 0 and "Usage: moekit" in out and "No such option" not in out + err


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) or "moekit" for p, _ in COMMANDS])
def test_help_keeps_every_bracketed_word(capsys, path, cmd):
    """A help string's `[model]` must reach the screen: unescaped, rich takes it for a style tag."""
    code, out, _ = moekit(capsys, *path, "--help")
    assert code == 0
    texts = [cmd.help] + [getattr(p, "help", None) for p in cmd.params]
    wanted = [b for text in texts for b in _bracketed(text)]
    flat = " ".join(out.split())
    missing = [b for b in wanted if b not in flat]
    assert not missing, f"moekit {' '.join(path)} --help lost {missing}"
    assert "[[" not in out  # a metavar bracketed twice: click adds the brackets of an optional argument


def test_train_help_names_the_toml_tables(capsys):
    code, out, _ = moekit(capsys, "train", "--help")
    assert code == 0 and "TOML file with [model] and [train] tables." in " ".join(out.split())
