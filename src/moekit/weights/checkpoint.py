"""Where weights LIVE on disk: a Hugging Face checkpoint folder, read through safetensors only.

A folder holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Tensors are memory-mapped (safetensors' `safe_open`), so opening a
checkpoint reads headers only. Pickled formats (`*.bin`, `*.pt`) are refused, never loaded.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from moekit.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder (a checkpoint is a folder with config.json)")
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json in this folder")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None


# A header larger than this is a corrupted length field, not a real header (DeepSeek-V3's largest
# shard header is about 100 KB).
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class Header:
    """A safetensors file's header: where data starts, and each tensor's entry."""

    data_start: int  # 8 + header length
    tensors: dict[str, dict]  # name → {"dtype", "shape", "data_offsets"}
    file_size: int


def read_header(path: Path) -> Header:
    """Parse a safetensors header; a truncated or corrupted one is one CheckpointError line."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, MAX_HEADER):
                raise CheckpointError(f"{path}: truncated or corrupted safetensors header")
            raw = fh.read(header_len)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: corrupted safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, entry in tensors.items():
        if not (isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= entry.keys()):
            raise CheckpointError(f"{path}: corrupted safetensors header (entry {name})")
    return Header(data_start=8 + header_len, tensors=tensors, file_size=size)


def _check_header(path: Path) -> None:
    """Refuse a truncated or corrupted file before safetensors or the mmap touches it."""
    header = read_header(path)
    data_end = max((v["data_offsets"][1] for v in header.tensors.values()), default=0)
    if header.data_start + data_end > header.file_size:
        missing = header.data_start + data_end - header.file_size
        raise CheckpointError(f"{path}: truncated safetensors file ({missing} bytes missing)")


def _shard_map(folder: Path) -> dict[str, Path]:
    """tensor name → shard file, from the index or the single file."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: not a valid safetensors index") from None
        shards = {name: folder / shard for name, shard in weight_map.items()}
        for shard in sorted(set(shards.values())):
            if not shard.is_file():
                raise CheckpointError(f"{folder}: missing shard {shard.name} (listed in {INDEX_NAME})")
        return shards
    single = folder / SINGLE_NAME
    if single.is_file():
        return {}  # filled from the file's own header below
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        if len(others) == 1:
            return {"": folder / others[0]}
        raise CheckpointError(
            f"{folder}: {len(others)} safetensors files but no {INDEX_NAME} saying which tensor is where"
        )
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
    if pickles:
        raise CheckpointError(
            f"{folder}: only pickled weights ({', '.join(pickles)}); moekit loads safetensors only"
        )
    raise CheckpointError(f"{folder}: no *.safetensors weights in this folder")


@dataclass
class Checkpoint:
    """An open checkpoint: its config and lazy, memory-mapped access to every tensor by Hub name."""

    folder: Path
    config: dict
    files: dict[str, Path]  # tensor name → file
    _handles: dict[Path, object] = field(default_factory=dict, repr=False)

    @property
    def tensor_names(self) -> list[str]:
        return sorted(self.files)

    def _handle(self, path: Path):
        from safetensors import safe_open

        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: cannot open safetensors file ({err})") from None
        return self._handles[path]

    def get(self, name: str):
        """The tensor `name` (a torch.Tensor backed by the mmap until copied)."""
        if name not in self.files:
            raise CheckpointError(f"{self.folder}: tensor {name} not found in the checkpoint")
        try:
            return self._handle(self.files[name]).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{self.files[name]}: cannot read tensor {name} ({err})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensor_names)

    def close(self) -> None:
        """Drop the open file handles (and their memory maps); get() reopens on demand."""
        self._handles.clear()


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Open a checkpoint folder: validate config, shards and safetensors headers; read no data."""
    folder = Path(folder)
    config = read_config(folder)
    shards = _shard_map(folder)
    if not shards:
        shards = {"": folder / SINGLE_NAME}
    files: dict[str, Path] = {}
    for path in sorted(set(shards.values())):
        _check_header(path)
    from safetensors import safe_open

    if "" in shards:  # one file, names from its header
        path = shards[""]
        with safe_open(str(path), framework="pt") as fh:
            files = {name: path for name in fh.keys()}
    else:
        files = dict(shards)
        for path in sorted(set(shards.values())):
            with safe_open(str(path), framework="pt") as fh:
                present = set(fh.keys())
            for name, shard in shards.items():
                if shard == path and name not in present:
                    raise CheckpointError(f"{path}: tensor {name} listed in the index but not in the file")
    return Checkpoint(folder=folder, config=config, files=files)
