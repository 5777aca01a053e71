"""A GGUF file: its metadata and tensor table, parsed here; llama.cpp's `gguf` package supplies the
type tables (GGMLQuantizationType, GGML_QUANT_SIZES) and, elsewhere, the dequantization.

Why not gguf.GGUFReader: it builds a numpy view per element of every metadata array, which makes
a 32k-token vocabulary cost 1-2 s and a 151k one (Qwen3's) several times that, paid by
`moekit calc x.gguf` and twice by `moekit run` (spec, then weights). The format is small
(gguf-py's own gguf_reader.py, GGUF v2/v3, little-endian): the header is parsed in one pass, numeric
arrays with np.frombuffer. tests/weights/test_gguf_file.py holds it equal to GGUFReader.

Opening memory-maps the file and reads the header only. Everything wrong with the file itself (not
GGUF, truncated, corrupted header) is one CheckpointError line. gguf and numpy are imported lazily,
so `moekit.spec` stays light.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moekit.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUFValueType → struct format of one scalar (8: string, 9: array are read apart)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: str  # GGMLQuantizationType name: F32, Q8_0, ...
    shape: tuple[int, ...]  # torch order, outermost first (GGUF's `ne` reversed)
    data: Any  # numpy view into the mmap: F32/F16 elements, else bytes ([..., bytes per row])
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]  # key → plain Python value (str, int, float, bool or list)
    tensors: dict[str, GGUFTensor]
    data_start: int = 0  # where tensor data begins: everything before it is the header (metadata, tensor table)
    mapping: Any = None  # the mmap.mmap every tensor's data views (None for an empty file)

    def drop_pages(self) -> None:
        """Unmap the pages read so far (they stay in the page cache, and a later read maps them
        again): a mapping's pages count in the process's RSS, on top of the copies made of them."""
        if self.mapping is not None:
            import mmap

            self.mapping.madvise(mmap.MADV_DONTNEED)


class _Header:
    """A cursor over the file's bytes; running past the end is a truncated header."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise CheckpointError(f"{self.path}: truncated GGUF (the header ends at byte {len(self.buf)})") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated GGUF (the header ends at byte {len(self.buf)})")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in NUMPY:
                import numpy as np

                size = np.dtype(NUMPY[item]).itemsize * count
                if self.pos + size > len(self.buf):
                    raise CheckpointError(f"{self.path}: truncated GGUF (the header ends at byte {len(self.buf)})")
                values = np.frombuffer(self.buf, dtype=NUMPY[item], count=count, offset=self.pos).tolist()
                self.pos += size
                return values
            return [self.value(item) for _ in range(count)]
        if vtype not in SCALARS:
            raise CheckpointError(f"{self.path}: corrupted GGUF header (value type {vtype} at byte {self.pos})")
        return self.scalar(SCALARS[vtype])


def _check_magic(path: Path) -> int:
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
    if head != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF with {MAGIC!r})")
    return size


def _tensor_view(mm, name: str, qtype, shape: tuple[int, ...], start: int, path: Path):
    """The reader's view of one tensor: elements for F32/F16, else bytes per row."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block:
        raise CheckpointError(f"{path}: corrupted GGUF (tensor {name}: rows of {shape[-1]} are not whole {qtype.name} blocks)")
    rows = shape[:-1]
    row_bytes = (shape[-1] if shape else 1) // block * type_size
    n_bytes = row_bytes * int(np.prod(rows, dtype=np.int64))
    if start + n_bytes > len(mm):
        raise CheckpointError(f"{path}: truncated GGUF (tensor {name} ends at byte {start + n_bytes}, the file has {len(mm)})")
    raw = mm[start : start + n_bytes]
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return raw.view(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16).reshape(shape), n_bytes
    return raw.reshape(*rows, row_bytes), n_bytes


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF's header (metadata and tensor infos); refuse a truncated or corrupted one."""
    path = Path(path)
    size = _check_magic(path)
    try:
        import numpy as np
        from gguf import GGMLQuantizationType
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF needs the gguf package (pip install gguf)") from None
    mapping = _map(path) if size else None
    mm = np.frombuffer(mapping, dtype=np.uint8) if size else np.zeros(0, np.uint8)
    h = _Header(mm, path)
    h.pos = 4
    version = h.scalar("<I")
    if version not in VERSIONS:
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (versions: {', '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = h.scalar("<Q"), h.scalar("<Q")
    if n_tensors > size or n_kv > size:  # each entry takes bytes: a count this large is a corrupted one
        raise CheckpointError(f"{path}: corrupted GGUF header ({n_tensors} tensors, {n_kv} metadata keys in {size} bytes)")
    metadata = {}
    for _ in range(n_kv):
        key = h.string()
        metadata[key] = h.value(h.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = h.string()
        ne = [h.scalar("<Q") for _ in range(h.scalar("<I"))]
        kind, offset = h.scalar("<I"), h.scalar("<Q")
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise CheckpointError(f"{path}: tensor {name} has GGML type {kind}, unknown to the gguf package") from None
        infos.append((name, qtype, tuple(reversed(ne)), offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: corrupted GGUF header (alignment {alignment})")
    data_start = -(-h.pos // alignment) * alignment
    tensors = {}
    for name, qtype, shape, offset in infos:
        data, n_bytes = _tensor_view(mm, name, qtype, shape, data_start + offset, path)
        tensors[name] = GGUFTensor(name, qtype.name, shape, data, data_start + offset, n_bytes)
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors, data_start=data_start,
                    mapping=mapping)


def _map(path: Path):
    """The whole file, mapped read-only (the mapping outlives the descriptor)."""
    import mmap

    with path.open("rb") as fh:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
