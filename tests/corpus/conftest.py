"""A small fixture tree with one file per kind of source the corpus reads."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from corpus_fixtures import FORTUNES, MAN_PAGE, SCRIPT


@pytest.fixture
def fixture_tree(tmp_path: Path) -> Path:
    man1 = tmp_path / "man" / "man1"
    man1.mkdir(parents=True)
    (man1 / "grep.1.gz").write_bytes(gzip.compress(MAN_PAGE.encode()))
    (man1 / "egrep.1.gz").write_bytes(gzip.compress(b".so man1/grep.1\n"))
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "script").write_text(SCRIPT)
    (bin_ / "copy").write_text(SCRIPT)  # an exact duplicate
    (bin_ / "tool").write_bytes(b"\x7fELF\x00\x00binary")
    (bin_ / "notes.txt").write_text("not a script\n")
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    (fortunes / "misc").write_text(FORTUNES)
    (fortunes / "misc.dat").write_bytes(b"\x00\x01")
    return tmp_path
