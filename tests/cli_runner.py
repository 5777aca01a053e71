"""Run `moekit ARGS` in-process, as a user would from a shell, for the CLI tests."""

from __future__ import annotations

import sys

import pytest


def moekit(capsys, *args) -> tuple[int, str, str]:
    """Run `moekit ARGS` through cli.main(); (exit code, stdout, stderr)."""
    from moekit import cli

    capsys.readouterr()  # drop what set-up printed (save_pretrained's progress bar)
    argv = sys.argv
    sys.argv = ["moekit", *map(str, args)]
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.main()
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return exit_.value.code or 0, out, err


def refused(capsys, *args) -> str:
    """Run `moekit ARGS` expecting a refusal: exit 2, nothing on stdout, one `error: ...` line on
    stderr (no traceback). Returns that line."""
    code, out, err = moekit(capsys, *args)
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err
