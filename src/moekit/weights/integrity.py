"""Checksums of weight bytes: a crc32 per byte range, checked as the range is read.

`moekit-experts.json` (moekit.weights.manifest) records a crc32 for every routed expert's extents
and for every other tensor of the checkpoint. A reader checks the bytes it has just read against
them; a mismatch is one CheckpointError line naming what (a tensor, an expert) and the file, never
wrong weights.

- `check_bytes(data, ...)`: the bytes are already in memory (a memory-mapped tensor, a buffer).
- `check_range(path, offset, length, crc32, what)`: read the range with pread and check it; for a
  reader that keeps its own file handles (a GGUF reader checking one tensor's byte range).
- `Verifier`: checks handed to worker threads. zlib.crc32 releases the GIL on buffers over a few
  KB, so a check runs while the loader copies the next tensor; `wait()` raises the first mismatch.

No torch: the manifest and `moekit checksum` use this on machines without it.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moekit.errors import CheckpointError

CHUNK = 64 * 1024 * 1024  # check_range reads in pieces: a huge tensor never needs one huge buffer
# Below this a check runs inline: handing it to a thread costs more than the crc32 (and zlib keeps
# the GIL for buffers under 5 KiB anyway).
INLINE_BYTES = 256 * 1024
# The loader copies on one thread; two checkers let a large tensor's check overlap the next one's.
# (Not tuned: on the 2-core machine it was measured on, no core was free to show a difference.)
WORKERS = 2


@dataclass(frozen=True)
class RangeCheck:
    """One byte range's recorded crc32. `offset` is relative to whatever buffer it is checked in
    (a tensor's bytes for Checkpoint.get, the file for check_range)."""

    offset: int
    length: int
    crc32: int
    what: str  # "tensor NAME" or "layer L expert E (tensor NAME)"

    @property
    def end(self) -> int:
        return self.offset + self.length


def crc32(data, value: int = 0) -> int:
    """zlib.crc32 of any buffer (bytes, memoryview, a numpy array of bytes)."""
    return zlib.crc32(data, value)


def mismatch(folder: Path, what: str, file: str, start: int, length: int, fix: str) -> CheckpointError:
    """The one line a failed check becomes: what, the file and the absolute byte range, what to do."""
    return CheckpointError(f"{folder}: {what}: checksum mismatch in {file} (bytes {start}..{start + length}); {fix}")


def first_bad(data, checks: tuple[RangeCheck, ...]) -> Optional[RangeCheck]:
    """The first check whose range of `data` (a flat byte buffer) does not match, None when all do."""
    view = memoryview(data).cast("B")
    for c in checks:
        if c.end > len(view) or zlib.crc32(view[c.offset : c.end]) != c.crc32:
            return c
    return None


def check_range(path: Path, offset: int, length: int, expected: int, what: str) -> None:
    """Read bytes offset..offset+length of `path` and check them against `expected` (a crc32):
    a CheckpointError naming `what` and the file on a mismatch or a short file."""
    value, done = 0, 0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot open ({err.strerror})") from None
    try:
        while done < length:
            data = os.pread(fd, min(CHUNK, length - done), offset + done)
            if not data:
                raise CheckpointError(f"{path}: {what}: truncated (bytes {offset}..{offset + length} run past its end)")
            value = zlib.crc32(data, value)
            done += len(data)
    finally:
        os.close(fd)
    if value != expected:
        raise CheckpointError(f"{path}: {what}: checksum mismatch (bytes {offset}..{offset + length})")


@dataclass(frozen=True)
class Failure:
    check: RangeCheck
    file: str  # relative to the folder
    start: int  # absolute offset of the checked buffer in the file

    def error(self, folder: Path, fix: str) -> CheckpointError:
        c = self.check
        return mismatch(folder, c.what, self.file, self.start + c.offset, c.length, fix)


class Verifier:
    """Checks run beside the reads: small ones inline, large ones on worker threads.

    Each submitted buffer is held until its check is done (a memory-mapped tensor keeps its map
    alive that long), so `wait()` is what bounds memory: Checkpoint.close() calls it."""

    def __init__(self, workers: int = WORKERS):
        self.workers = workers
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: list[tuple[Future, str, int]] = []
        self.checked_bytes = 0

    def submit(self, data, checks: tuple[RangeCheck, ...], file: str, start: int) -> Optional[Failure]:
        """Check `data` (the bytes of file at start..) against `checks`; a Failure found inline is
        returned at once, one found on a worker by the next wait()."""
        nbytes = sum(c.length for c in checks)
        self.checked_bytes += nbytes
        if nbytes < INLINE_BYTES:
            bad = first_bad(data, checks)
            return None if bad is None else Failure(bad, file, start)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="moekit-verify")
        self._pending.append((self._pool.submit(first_bad, data, checks), file, start))
        return None

    def wait(self) -> Optional[Failure]:
        """Block until every submitted check is done; the first Failure in submission order, if any.
        The worker threads stop here; a later submit starts new ones."""
        pending, self._pending = self._pending, []
        failure = None
        for future, file, start in pending:
            bad = future.result()
            if bad is not None and failure is None:
                failure = Failure(bad, file, start)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        return failure
