"""Where each domain's raw documents come from on a Debian machine: data, read by shared code.

A Source names its domain, the Debian packages that provide it, and a finder that yields
(origin, raw text) pairs. Finders read files in sorted order so a build is reproducible on the same
installed packages. The Python stdlib needs no package: it is the running interpreter's own.
"""

from __future__ import annotations

import gzip
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from moekit.corpus.clean import man_page_family
from moekit.corpus.roff import roff_to_text

MAN_PAGES_PER_FAMILY = 40  # git has ~170 pages, gcloud ~16,000: a family is a voice, not the domain

Doc = tuple[str, str]  # (origin: a path, or path#n for one fortune; raw text)

SHELL_SHEBANGS = ("#!/bin/sh", "#!/bin/bash", "#!/bin/dash", "#!/usr/bin/env bash", "#!/usr/bin/env sh",
                  "#! /bin/sh", "#!/usr/bin/bash")


def _read_text(path: Path, limit: int = 2_000_000) -> str | None:
    """A file's text (gunzipped if .gz), or None if unreadable, binary, or larger than `limit` bytes."""
    try:
        if path.stat().st_size > limit:
            return None
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\x00" in raw[:4096]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _files(root: Path, pattern: str = "*") -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob(pattern) if p.is_file() and not p.is_symlink())


def man_pages(roots: list[Path]) -> Iterator[Doc]:
    """Every page under man1…man8 of `roots`, rendered to text."""
    for root in roots:
        for section in sorted(root.glob("man[1-8]")):
            for path in _files(section):
                text = _read_text(path)
                if text is not None and not text.lstrip().startswith(".so "):  # .so: an alias page
                    yield str(path), roff_to_text(text)


def python_stdlib(root: Path | None = None) -> Iterator[Doc]:
    """The running interpreter's standard library (.py files), without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    for path in _files(root, "*.py"):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        text = _read_text(path)
        if text is not None:
            yield str(path), text


def shell_scripts(roots: list[Path]) -> Iterator[Doc]:
    """Files under `roots` that start with a shell shebang."""
    for root in roots:
        for path in _files(root):
            try:
                with path.open("rb") as fh:
                    head = fh.read(32)
            except OSError:
                continue
            if head.startswith(tuple(s.encode() for s in SHELL_SHEBANGS)):
                text = _read_text(path)
                if text is not None:
                    yield str(path), text


def fortunes(root: Path) -> Iterator[Doc]:
    """Each %-separated fortune of the data files in `root` is one document (offensive ones skipped)."""
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if not path.is_file() or path.suffix in (".dat", ".u8") or path.is_symlink():
            continue
        text = _read_text(path)
        if text is None:
            continue
        for n, piece in enumerate(text.split("\n%\n")):
            yield f"{path}#{n}", piece


@dataclass(frozen=True)
class Source:
    domain: str
    description: str
    packages: tuple[str, ...]  # Debian packages that provide it (empty: always present)
    find: Callable[[], Iterator[Doc]]
    min_chars: int  # documents shorter than this after cleaning are dropped
    max_chars: int  # ... and longer than this (generated tables, vendored blobs)
    family: Callable[[str], str] | None = None  # origin → its family, for the per-family cap
    max_docs_per_family: int = 0  # 0: no cap


def default_sources() -> list[Source]:
    man = Path("/usr/share/man")
    return [
        Source("manpages", "English technical prose: man pages (sections 1-8) of installed packages",
               ("man-db", "manpages", "manpages-dev"), lambda: man_pages([man]), 300, 150_000,
               man_page_family, MAN_PAGES_PER_FAMILY),
        Source("python", "source code: the Python standard library's .py files",
               (), python_stdlib, 200, 150_000),
        Source("shell", "shell scripts: /usr/bin, /usr/sbin, /usr/lib, /etc files with a shell shebang",
               (), lambda: shell_scripts([Path("/usr/bin"), Path("/usr/sbin"), Path("/etc"), Path("/usr/lib")]),
               100, 100_000),
        Source("fortunes", "short English prose: fortune cookies (%-separated)",
               ("fortunes", "fortunes-min"), lambda: fortunes(Path("/usr/share/games/fortunes")), 20, 4_000),
        Source("chinese", "Chinese: man pages of manpages-zh (zh_CN, zh_TW)",
               ("manpages-zh",), lambda: man_pages([man / "zh_CN", man / "zh_TW"]), 200, 150_000,
               man_page_family, MAN_PAGES_PER_FAMILY),
    ]


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0
