"""Where weights LIVE on disk: a Hugging Face checkpoint folder, read through safetensors only.

A folder holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Tensors are memory-mapped (safetensors' `safe_open`), so opening a
checkpoint reads headers only. Pickled formats (`*.bin`, `*.pt`) are refused, never loaded.

Integrity: when `moekit-experts.json` lies beside the checkpoint, `get` checks the bytes of every
tensor it returns against the crc32s there (whole tensors, and the routed experts' extents inside
stacked ones; moekit.weights.manifest.tensor_checks), on worker threads while the caller copies
(moekit.weights.integrity.Verifier); `close` waits for them and raises the first mismatch, one
CheckpointError line naming the tensor or expert and the file. The manifest is read on the first
`get`, so anything reading through a Checkpoint (the MXFP4 / FP8 views keep theirs as an attribute:
`base_checkpoint`) is verified without asking. `verify = False` skips it. Nothing here writes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

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
    if header.data_start + data_end < header.file_size:  # safetensors refuses these with its own traceback
        extra = header.file_size - header.data_start - data_end
        raise CheckpointError(f"{path}: corrupted safetensors file ({extra} bytes after the last tensor)")


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
    verify: bool = True  # check what get() reads against moekit-experts.json, when there is one
    notes: list[str] = field(default_factory=list)  # what verification decided that the user should hear
    _checks: Optional[dict] = field(default=None, repr=False)  # tensor name → its RangeChecks; None: not read yet
    _placements: dict = field(default_factory=dict, repr=False)  # tensor name → (file, absolute offset, length)
    _verifier: Optional[object] = field(default=None, repr=False)

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
        """The tensor `name` (a torch.Tensor backed by the mmap until copied), its checks started."""
        if name not in self.files:
            raise CheckpointError(f"{self.folder}: tensor {name} not found in the checkpoint")
        try:
            tensor = self._handle(self.files[name]).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{self.files[name]}: cannot read tensor {name} ({err})") from None
        checks = self._checks_of(name)
        if checks:
            import torch

            file, start, _ = self._placements[name]
            raw = tensor.reshape(-1).view(torch.uint8).numpy()  # the stored bytes, no copy
            failure = self._verifier.submit(raw, checks, file, start)
            if failure is not None:
                raise failure.error(self.folder, _changed())
        return tensor

    def _checks_of(self, name: str) -> tuple:
        if not self.verify:
            return ()
        if self._checks is None:
            self._start_verifying()
        return self._checks.get(name, ())

    def _start_verifying(self) -> None:
        """Read the manifest beside the checkpoint (if any) and map its checksums onto tensors."""
        from moekit.weights.manifest import read_manifest

        self._checks = {}
        manifest = read_manifest(self.folder)
        if manifest is None:
            return
        from moekit.weights.manifest import MANIFEST_NAME, check_fingerprint, tensor_checks
        from moekit.spec.loading import spec_from_config
        from moekit.weights.integrity import Verifier

        check_fingerprint(self.folder, spec_from_config(self.config, self.folder.name), manifest, require_experts=False)
        self._placements = placements(self)
        self._checks = tensor_checks(self.folder, manifest, self._placements)
        self._verifier = Verifier()
        unchecked = len(set(self.files) - set(self._checks))
        if manifest.tensors is None and unchecked:
            self.notes.append(
                f"{MANIFEST_NAME} has no checksums for {unchecked} of the checkpoint's {len(self.files)} tensors "
                f"(an earlier moekit or moekit pack wrote it): those load unverified; "
                f"`moekit checksum {self.folder}` adds them"
            )

    def wait_verified(self) -> None:
        """Block until every check started by get() is done; the first mismatch as a CheckpointError."""
        if self._verifier is not None:
            failure = self._verifier.wait()
            if failure is not None:
                raise failure.error(self.folder, _changed())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensor_names)

    def close(self) -> None:
        """Wait for pending checks (they hold the tensors they read), then drop the open file
        handles and their memory maps; get() reopens on demand. Raises the first mismatch."""
        try:
            self.wait_verified()
        finally:
            self._handles.clear()


def _changed() -> str:
    from moekit.weights.manifest import CHANGED

    return CHANGED


def placements(ckpt: Checkpoint) -> dict[str, tuple[str, int, int]]:
    """tensor name → (file relative to the folder, absolute byte offset, length), from the headers."""
    out = {}
    for path in sorted(set(ckpt.files.values())):
        header = read_header(path)
        for name, entry in header.tensors.items():
            if ckpt.files.get(name) == path:
                begin, end = entry["data_offsets"]
                out[name] = (path.relative_to(ckpt.folder).as_posix(), header.data_start + begin, end - begin)
    return out


def base_checkpoint(ckpt) -> Optional[Checkpoint]:
    """The safetensors Checkpoint a reader reads through: `ckpt` itself, or the one a wrapper keeps
    as an attribute (QuantizedCheckpoint.inner). None when neither: its reads are its own to check."""
    if isinstance(ckpt, Checkpoint):
        return ckpt
    return next((v for v in getattr(ckpt, "__dict__", {}).values() if isinstance(v, Checkpoint)), None)


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Open a checkpoint folder: validate config, shards and safetensors headers; read no data."""
    folder = Path(folder)
    if folder.suffix == ".gguf" and not folder.is_dir():  # a GGUF file: Checkpoint's interface over it
        from moekit.weights.gguf_checkpoint import open_gguf

        return open_gguf(folder)  # type: ignore[return-value]
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
    from moekit.weights.quantized import quantized_view

    # MXFP4 / FP8 checkpoints (quantization_config): the same interface, bf16 names and shapes.
    return quantized_view(Checkpoint(folder=folder, config=config, files=files))
