"""Checkpoint folders for the expert-store tests: tiny ones in other dtypes and shardings, byte-level
damage, and read-only copies a process really cannot write (root ignores permission bits, so a
root test runs the command without the capability that lets it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import pytest

from hf_tiny import build_reference

MOEKIT = Path(sys.executable).parent / "moekit"
# The capabilities that let root write into a folder whose mode forbids it.
_OVERRIDES = "-dac_override,-dac_read_search"


def write_tiny(family: str, folder: Path, dtype=None, max_shard_size: Optional[str] = None, seed: int = 0) -> Path:
    """hf_tiny's checkpoint of `family`, optionally cast (torch.bfloat16) or split into shards."""
    model = build_reference(family, seed)
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))


@contextmanager
def readonly_copy(src: Path) -> Iterator[Path]:
    """A copy of checkpoint `src` whose folder and files are read-only (mode 555 / 444)."""
    base = Path(tempfile.mkdtemp(prefix="moekit-readonly-"))
    folder = base / src.name
    shutil.copytree(src, folder)
    for p in folder.iterdir():
        p.chmod(0o444)
    folder.chmod(0o555)
    try:
        yield folder
    finally:
        folder.chmod(0o755)
        shutil.rmtree(base)


def run_unprivileged(args: list[str]) -> subprocess.CompletedProcess:
    """Run `args` so that file permission bits apply to it, even when the tests run as root."""
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: permission bits cannot be enforced")
        args = [setpriv, f"--inh-caps={_OVERRIDES}", f"--bounding-set={_OVERRIDES}", *args]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)
