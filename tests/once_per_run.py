"""What the xdist workers of one pytest run share: a lock, and files made once for all of them.

Under `pytest -n N` each worker is a process with its own session fixtures; a session fixture that
writes a checkpoint or converts a GGUF would do it N times. These helpers put such files in the
folder the run's workers share, made by the first worker that asks."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


def run_folder(config, tmp_path_factory) -> Path:
    """The folder of this pytest run that all its xdist workers share (each worker's base temp is
    <it>/popen-gwN); without xdist, the run's own base temp. Never another run's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


@contextmanager
def run_lock(config, tmp_path_factory, name: str) -> Iterator[None]:
    """An exclusive lock that this run's workers share (a file lock: a dead worker releases it)."""
    import fcntl

    with open(run_folder(config, tmp_path_factory) / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def made_once(config, tmp_path_factory, name: str, make: Callable[[Path], Path]) -> Path:
    """What make(an empty folder) returns, made once per run: under xdist the first worker to ask
    makes it in the run's shared folder and the others wait for it, then read the same files.
    (What session fixtures hand out this way is read-only to the tests, as it always was.)"""
    root = run_folder(config, tmp_path_factory)
    made = root / f"{name}.made"
    with run_lock(config, tmp_path_factory, name):
        if not made.exists():
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)  # a worker that died half-way
            folder.mkdir()
            made.write_text(str(make(folder)))
    return Path(made.read_text())
