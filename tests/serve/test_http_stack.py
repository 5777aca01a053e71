"""The event loop and HTTP parser `moekit serve` runs uvicorn on (moekit.serve.http_stack)."""

from __future__ import annotations

from pathlib import Path

from moekit.serve.http_stack import HttpStack, http_stack


def test_uvloop_and_httptools_when_installed():
    assert http_stack(lambda module: True) == HttpStack(loop="uvloop", http="httptools")


def test_each_missing_one_falls_back_with_a_note_naming_it():
    no_uvloop = http_stack(lambda module: module != "uvloop")
    assert (no_uvloop.loop, no_uvloop.http) == ("asyncio", "httptools")
    assert len(no_uvloop.notes) == 1 and no_uvloop.notes[0].startswith("uvloop is not installed")
    neither = http_stack(lambda module: False)
    assert (neither.loop, neither.http) == ("asyncio", "h11")
    assert [note.split()[0] for note in neither.notes] == ["uvloop", "httptools"]


def test_the_server_runs_on_uvloop_and_httptools_and_says_so(server):
    """Both are moekit's dependencies: the server names them, and their extension modules are loaded."""
    line = next(line for line in server.log if line.startswith("serving "))
    assert line.endswith(", uvloop + httptools)"), line
    assert not any(line.startswith("note: uvloop") or line.startswith("note: httptools") for line in server.log)
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "/uvloop/loop." in maps and "/httptools/parser/" in maps
