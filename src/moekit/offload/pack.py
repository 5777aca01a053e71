"""`moekit pack`: every routed expert rewritten in our layout, one expert's bytes next to each other.

A checkpoint keeps an expert's pieces where its family put them: three tensors (per-expert
families), rows of two stacked tensors far apart (granitemoe), or transposed, interleaved slices
(gpt_oss). The packed file holds, for each MoE layer l and expert e in order,
`layers.{l}.experts.{e}.gate_up` [rows, D] then `layers.{l}.experts.{e}.down` [D, F] in the
checkpoint's dtype: one positioned read per expert, no re-layout on load. It is a valid
safetensors file, written here byte by byte (header, then the tensors in exactly that order:
safetensors' own writer sorts tensors by dtype and name, which would not keep them so), streamed
one expert at a time, to a temporary file then os.replace'd. The manifest (moekit-experts.json)
then points at it, with each extent's crc32 computed from the bytes written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

import torch

from moekit.errors import MoekitError
from moekit.offload.extents import (
    ITEMSIZE,
    PACKED_NAME,
    Extent,
    ExpertExtents,
    ExtentMap,
    expert_extents,
    our_shapes,
    referenced_files,
    weight_files,
)
from moekit.offload.manifest import (
    MANIFEST_NAME,
    Manifest,
    Progress,
    check_fingerprint,
    fingerprint,
    read_manifest,
    require_moe,
    write_manifest,
)
from moekit.offload.reader import ExpertReader
from moekit.spec.loading import spec_from_config
from moekit.spec.model_spec import ModelSpec
from moekit.weights.checkpoint import read_config

HEADER_ALIGN = 8  # safetensors pads its header with spaces to a multiple of 8


@dataclass(frozen=True)
class PackResult:
    path: Path  # the packed file
    manifest: Path
    experts: int
    layers: int
    nbytes: int  # size of the packed file
    seconds: float


@dataclass(frozen=True)
class _Entry:
    key: tuple[int, int]  # (layer, expert)
    part: str  # "gate_up" or "down"
    dtype: str
    shape: tuple[int, int]
    begin: int  # offsets in the data section, as safetensors' data_offsets

    @property
    def name(self) -> str:
        return f"layers.{self.key[0]}.experts.{self.key[1]}.{self.part}"

    @property
    def length(self) -> int:
        return self.shape[0] * self.shape[1] * ITEMSIZE[self.dtype]


def _part_dtype(extents: tuple[Extent, ...], key: tuple[int, int], folder: Path) -> str:
    dtypes = {x.dtype for x in extents}
    if len(dtypes) > 1:
        raise MoekitError(
            f"{folder}: layer {key[0]} expert {key[1]} mixes dtypes {sorted(dtypes)} in one weight; cannot pack it"
        )
    return dtypes.pop()


def layout(folder: Path, extents: ExtentMap) -> dict[tuple[int, int], tuple[_Entry, _Entry]]:
    """Each expert's two tensors in the packed file, in file order: gate_up then down, expert by expert."""
    entries = {}
    begin = 0
    for key, ex in sorted(extents.items()):
        up_shape, down_shape = our_shapes(ex)
        gate_up = _Entry(key, "gate_up", _part_dtype(ex.gate_up, key, folder), up_shape, begin)
        down = _Entry(key, "down", _part_dtype(ex.down, key, folder), down_shape, gate_up.begin + gate_up.length)
        entries[key] = (gate_up, down)
        begin = down.begin + down.length
    return entries


def header_bytes(entries: list[_Entry], spec: ModelSpec) -> bytes:
    header: dict = {"__metadata__": {"format": "pt", "producer": "moekit pack", "model_type": spec.model_type}}
    for x in entries:
        header[x.name] = {"dtype": x.dtype, "shape": list(x.shape), "data_offsets": [x.begin, x.begin + x.length]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % HEADER_ALIGN)


def _writable(folder: Path) -> bool:
    """Whether files can be created in `folder` (an unnamed temporary file: nothing is left)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _relative(out: Path, folder: Path) -> str:
    try:
        return str(out.resolve().relative_to(folder.resolve()))
    except ValueError:
        return str(out.resolve())


def _source(folder: Path, spec: ModelSpec, extents: ExtentMap) -> Union[Manifest, ExtentMap]:
    """A matching checkpoint manifest already checksummed these bytes: read through it, so a
    corrupted checkpoint is an error here rather than a packed file with fresh checksums."""
    try:
        found = read_manifest(folder)
        if found is None or found.source != "checkpoint":
            return extents
        check_fingerprint(folder, spec, found)
    except MoekitError:
        return extents  # stale or foreign: pack replaces it anyway
    return found if all(_without_crcs(found.experts[k]) == ex for k, ex in extents.items()) else extents


def _without_crcs(ex: ExpertExtents) -> ExpertExtents:
    bare = [replace(x, crc32=None) for x in ex.extents]
    return replace(ex, gate_up=tuple(bare[: len(ex.gate_up)]), down=tuple(bare[len(ex.gate_up) :]))


def _check_out(out: Path, folder: Path) -> None:
    if not out.parent.is_dir():
        raise MoekitError(f"--out {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise MoekitError(f"--out {out} is a folder; give a file name")
    protected = {(folder / f).resolve() for f in set(weight_files(folder).values())}
    protected |= {(folder / "config.json").resolve(), (folder / MANIFEST_NAME).resolve()}
    if out.resolve() in protected:
        raise MoekitError(f"--out {out} would overwrite the checkpoint's own files; choose another name")


def pack_experts(
    checkpoint: Union[str, Path], out: Optional[Union[str, Path]] = None, progress: Optional[Progress] = None
) -> PackResult:
    """Write CHECKPOINT/experts.packed.safetensors (or `out`) and the manifest that points at it."""
    start = time.perf_counter()
    folder = Path(checkpoint)
    spec = spec_from_config(read_config(folder), folder.name)
    require_moe(spec, folder)
    out = folder / PACKED_NAME if out is None else Path(out)
    _check_out(out, folder)
    for where in {folder, out.parent}:
        if not _writable(where):
            raise MoekitError(
                f"{where}: cannot write here (read-only or permission denied); moekit pack writes "
                f"{out.name} and {MANIFEST_NAME} beside the checkpoint (--out can put the packed file elsewhere)"
            )
    extents = expert_extents(folder, spec)
    entries = layout(folder, extents)
    header = header_bytes([x for pair in entries.values() for x in pair], spec)
    total = 8 + len(header) + sum(x.length for pair in entries.values() for x in pair)
    free = shutil.disk_usage(out.parent).free
    if free < total:
        raise MoekitError(f"{out.parent}: {total:,} bytes needed for the packed experts, {free:,} free")

    rel = _relative(out, folder)
    data_start = 8 + len(header)
    packed: dict[tuple[int, int], list[Extent]] = {}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with ExpertReader(folder, _source(folder, spec, extents), dtype=None) as reader, open(tmp, "wb") as fh:
            fh.write(len(header).to_bytes(8, "little"))
            fh.write(header)
            for done, (key, pair) in enumerate(entries.items()):
                for tensor, entry in zip(reader.read(*key), pair):
                    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                    assert data.nbytes == entry.length, (entry.name, data.nbytes, entry.length)
                    fh.write(data)
                    x = Extent(rel, data_start + entry.begin, entry.length, entry.dtype, entry.shape, zlib.crc32(data))
                    packed.setdefault(key, []).append(x)
                if progress is not None:
                    progress(done + 1, len(extents))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

    experts = {key: ExpertExtents((gu,), (dn,)) for key, (gu, dn) in packed.items()}
    manifest = Manifest(
        fingerprint(folder, spec, [rel, *referenced_files(extents)]),
        experts,
        source="packed",
        packed_file=rel,
        built=True,
    )
    if not write_manifest(folder, manifest):
        raise MoekitError(f"{folder}: cannot write {MANIFEST_NAME} (read-only or permission denied)")
    return PackResult(
        path=out,
        manifest=folder / MANIFEST_NAME,
        experts=len(experts),
        layers=len(spec.moe_layers),
        nbytes=out.stat().st_size,
        seconds=time.perf_counter() - start,
    )
