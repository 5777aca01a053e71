"""`--help` as a person reads it (issue 42, item 11): a flag shows no `<bool>` as if it took a value,
and a sentence broken across lines in the source reflows at the terminal's width."""

from __future__ import annotations

import pytest
import typer

from cli_runner import moekit
from moekit.commands.help_text import unwrap


def _command_paths() -> list[tuple[str, ...]]:
    from moekit import cli

    cli._register()
    out, todo = [], [((), typer.main.get_command(cli.app))]
    while todo:
        path, cmd = todo.pop()
        out.append(path)
        todo += [((*path, name), sub) for name, sub in getattr(cmd, "commands", {}).items()]
    return sorted(out)


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "moekit")
def test_no_help_shows_a_type_for_a_flag(capsys, monkeypatch, path):
    monkeypatch.setenv("COLUMNS", "120")
    code, out, _ = moekit(capsys, *path, "--help")
    assert code == 0 and "<bool>" not in out
    assert "-h " in out  # the help flag is still listed, only without a type


@pytest.mark.parametrize("columns", [80, 100, 160])
def test_a_sentence_reflows_at_the_terminals_width(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, _ = moekit(capsys, "corpus", "build", "--help")
    assert code == 0
    prose = [line.strip() for line in out.splitlines() if line.startswith(" ") and "│" not in line and line.strip()]
    body = " ".join(prose)
    assert "fortunes (short English prose)" in body
    domains = next(i for i, line in enumerate(prose) if line.startswith("Domains:"))
    # every line of the paragraph but its last is filled to near the width, none cut where the source was
    paragraph = prose[domains:domains + 3]
    assert all(len(line) > columns - 25 for line in paragraph[:-1]), paragraph
    if columns >= 160:
        assert "fortunes (short English prose)" in paragraph[0]


def test_unwrap_keeps_examples_and_lists_on_their_own_lines():
    text = "A sentence broken\nin the source.\n\nExamples:\n  moekit run x\n  moekit run y\n\n- one\n- two"
    assert unwrap(text) == "A sentence broken in the source.\n\nExamples:\n  moekit run x\n  moekit run y\n\n- one\n- two"
