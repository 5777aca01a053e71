"""A checkpoint's fingerprint, exchanged by the ranks at start: the same model on every rank or none.

config.json's bytes, each safetensors file's name, size and header, and samples of its data (the
first and last MiB and 16 blocks between): two checkpoints of one config with different weights
differ in every sample, and reading a few MiB keeps the start fast for a 100 GB model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLE = 1 << 20  # bytes read at each end of a file
BLOCKS = 16  # further 64 KiB blocks, evenly spaced
BLOCK = 1 << 16


def _sample(path: Path, digest) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with path.open("rb") as fh:
        offsets = [0, max(0, size - SAMPLE)] + [size * (i + 1) // (BLOCKS + 1) for i in range(BLOCKS)]
        for offset in offsets:
            fh.seek(offset)
            digest.update(fh.read(SAMPLE if offset in offsets[:2] else BLOCK))


def checkpoint_fingerprint(folder: str | Path) -> str:
    folder = Path(folder)
    digest = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        _sample(path, digest)
    return digest.hexdigest()
