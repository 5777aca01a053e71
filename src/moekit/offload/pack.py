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

With `precisions` ((layer, expert) → bf16 / fp32 / int8 / int4, moekit.offload.precision) each
expert is written at its own precision instead: a float cast (the engine's own cast, so a bf16
expert packed from a bf16 checkpoint is the same bytes), or q8_0 / q4_0 blocks quantized here from
the stored values, laid out as the int8 / int4 kernels read them (U8 tensors in the file, Q8_0 /
Q4_0 extents in the manifest). The store then reads those bytes straight into use.

The checkpoint itself is never changed (it may be the bundled model, or anyone's download): pack
writes a new folder, the packed checkpoint, that `moekit run` loads like any other. It holds the
packed file, its manifest, and the checkpoint's other top-level files (config, tokenizer, the
safetensors the dense weights come from) hard-linked where the filesystem allows, else copied:
no byte of the original is written either way. The folder is --out, or by default one per
checkpoint under the user's cache directory (default_pack_dir).
"""

from __future__ import annotations

import hashlib
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
from moekit.weights.extents import (
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
from moekit.weights.manifest import (
    MANIFEST_NAME,
    Manifest,
    Progress,
    check_fingerprint,
    fingerprint,
    read_manifest,
    require_moe,
    with_tensor_sums,
    write_manifest,
)
from moekit.offload.precision import STORED, Precisions, describe, is_quantized, quantized_shape
from moekit.offload.reader import TORCH_DTYPES, ExpertReader
from moekit.spec.loading import spec_from_config
from moekit.spec.model_spec import ModelSpec
from moekit.weights.checkpoint import read_config

HEADER_ALIGN = 8  # safetensors pads its header with spaces to a multiple of 8


@dataclass(frozen=True)
class PackResult:
    folder: Path  # the packed checkpoint: load this one
    path: Path  # the packed file in it
    manifest: Path
    linked: tuple[str, ...]  # the checkpoint's files hard-linked into folder
    copied: tuple[str, ...]  # ... and those copied (another filesystem)
    experts: int
    layers: int
    nbytes: int  # size of the packed file
    seconds: float
    precision: str = "as stored"  # e.g. "32 bf16 + 96 int4"


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
    def file_dtype(self) -> str:
        """The safetensors dtype of the tensor in the file: a block format is its bytes."""
        return "U8" if is_quantized(self.dtype) else self.dtype

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


def _stored(dtype: str, shape: tuple[int, int]) -> tuple[int, int]:
    return quantized_shape(dtype, shape) if is_quantized(dtype) else shape


def layout(folder: Path, extents: ExtentMap, precisions: Optional[Precisions] = None) -> dict[tuple[int, int], tuple[_Entry, _Entry]]:
    """Each expert's two tensors in the packed file, in file order: gate_up then down, expert by
    expert; at the checkpoint's dtype, or at precisions[key] when given."""
    entries = {}
    begin = 0
    for key, ex in sorted(extents.items()):
        up_shape, down_shape = our_shapes(ex)
        up_dtype, down_dtype = _part_dtype(ex.gate_up, key, folder), _part_dtype(ex.down, key, folder)
        if precisions is not None:
            up_dtype = down_dtype = STORED[precisions[key]]
        gate_up = _Entry(key, "gate_up", up_dtype, _stored(up_dtype, up_shape), begin)
        down = _Entry(key, "down", down_dtype, _stored(down_dtype, down_shape), gate_up.begin + gate_up.length)
        entries[key] = (gate_up, down)
        begin = down.begin + down.length
    return entries


def header_bytes(entries: list[_Entry], spec: ModelSpec, precision: str = "as stored") -> bytes:
    header: dict = {"__metadata__": {"format": "pt", "producer": "moekit pack", "model_type": spec.model_type,
                                     "precision": precision}}
    for x in entries:
        header[x.name] = {"dtype": x.file_dtype, "shape": list(x.shape), "data_offsets": [x.begin, x.begin + x.length]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % HEADER_ALIGN)


def _writable(folder: Path) -> bool:
    """Whether files can be created in `folder` (an unnamed temporary file: nothing is left)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def default_pack_dir(checkpoint: Path) -> Path:
    """$XDG_CACHE_HOME (else ~/.cache)/moekit/packed/<name>-<hash of its absolute path>: one per checkpoint."""
    folder = checkpoint.resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = hashlib.sha256(str(folder).encode()).hexdigest()[:10]
    return cache / "moekit" / "packed" / f"{folder.name}-{tag}"


def _is_previous_pack(dest: Path) -> bool:
    try:
        found = read_manifest(dest)
    except MoekitError:
        return False
    return found is not None and found.source == "packed"


def _check_dest(dest: Path, folder: Path, explicit: bool) -> None:
    """The packed checkpoint goes to a new folder, an empty one, or one an earlier pack wrote."""
    name = f"--out {dest}" if explicit else str(dest)
    src, out = folder.resolve(), dest.resolve()
    if out == src or src in out.parents:
        raise MoekitError(f"{name}: moekit pack never writes into the checkpoint it packs; name a folder outside {folder}")
    if out in src.parents:
        raise MoekitError(f"{name} holds the checkpoint {folder}; name a new folder for the packed checkpoint")
    if dest.exists() and not dest.is_dir():
        raise MoekitError(f"{name} is a file; name a folder for the packed checkpoint")
    if dest.is_dir() and any(dest.iterdir()) and not _is_previous_pack(dest):
        raise MoekitError(f"{name} exists and holds other files; name a new or empty folder")
    if explicit and not dest.parent.is_dir():
        raise MoekitError(f"{name}: folder {dest.parent} does not exist")


def _mirror(folder: Path, dest: Path) -> tuple[list[str], list[str]]:
    """The checkpoint's top-level files (not its manifest or packed file) into dest. The weights
    are hard-linked where the filesystem allows (nothing writes a safetensors file in place); the
    small files are copied, so editing the packed checkpoint's config never edits the original's.
    (linked, copied) names."""
    linked, copied = [], []
    skip = {MANIFEST_NAME, PACKED_NAME}
    for src in sorted(p for p in folder.iterdir() if p.is_file() and p.name not in skip and not p.name.startswith(".")):
        target = dest / src.name
        target.unlink(missing_ok=True)
        if src.suffix == ".safetensors":
            try:
                os.link(src, target)
                linked.append(src.name)
                continue
            except OSError:
                pass  # another filesystem: copy
        shutil.copyfile(src, target)
        copied.append(src.name)
    return linked, copied


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


def encode(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """One weight of our layout [out, in], as stored, → its bytes at `dtype` (a float or a block format)."""
    if dtype == "Q8_0":
        from moekit.model.int8 import quantize_q8_0

        return quantize_q8_0(tensor)
    if dtype == "Q4_0":
        from moekit.model.int4 import quantize_q4_0

        return quantize_q4_0(tensor)
    return tensor.to(TORCH_DTYPES[dtype])


def pack_experts(
    checkpoint: Union[str, Path], out: Optional[Union[str, Path]] = None, progress: Optional[Progress] = None,
    precisions: Optional[Precisions] = None,
) -> PackResult:
    """Write the packed checkpoint `out` (default: default_pack_dir) and leave `checkpoint` as it was.
    precisions: (layer, expert) → the precision to write it at (every expert); None: as stored."""
    start = time.perf_counter()
    folder = Path(checkpoint)
    spec = spec_from_config(read_config(folder), folder.name)
    require_moe(spec, folder)
    dest = default_pack_dir(folder) if out is None else Path(out)
    _check_dest(dest, folder, explicit=out is not None)
    created = not dest.exists()
    try:
        dest.mkdir(parents=out is None, exist_ok=True)
    except OSError as err:
        raise MoekitError(f"{dest}: cannot create the packed checkpoint here ({err.strerror})") from None
    try:
        return _pack_into(folder, dest, spec, progress, start, precisions)
    except BaseException:
        if created:
            shutil.rmtree(dest, ignore_errors=True)
        raise


def _pack_into(folder: Path, dest: Path, spec: ModelSpec, progress: Optional[Progress], start: float,
               precisions: Optional[Precisions] = None) -> PackResult:
    if not _writable(dest):
        raise MoekitError(f"{dest}: cannot write here (read-only or permission denied); --out names another folder")
    extents = expert_extents(folder, spec)
    if precisions is not None and set(precisions) != set(extents):
        raise MoekitError(f"{folder}: the precisions given do not name every routed expert of this model")
    entries = layout(folder, extents, precisions)
    precision = describe(precisions) if precisions is not None else "as stored"
    header = header_bytes([x for pair in entries.values() for x in pair], spec, precision)
    total = 8 + len(header) + sum(x.length for pair in entries.values() for x in pair)
    free = shutil.disk_usage(dest).free
    if free < total:
        raise MoekitError(f"{dest}: {total:,} bytes needed for the packed experts, {free:,} free")

    out = dest / PACKED_NAME
    data_start = 8 + len(header)
    packed: dict[tuple[int, int], list[Extent]] = {}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    # One intra-op thread while quantizing: an expert's weights are small, and OpenMP's barriers
    # made quantize_q8_0 of a 104 × 224 weight take 10 ms on 2 busy cores against 0.56 ms on one (measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ExpertReader(folder, _source(folder, spec, extents), dtype=None) as reader, open(tmp, "wb") as fh:
            fh.write(len(header).to_bytes(8, "little"))
            fh.write(header)
            for done, (key, pair) in enumerate(entries.items()):
                for tensor, entry in zip(reader.read(*key), pair):
                    data = encode(tensor, entry.dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
                    assert data.nbytes == entry.length, (entry.name, data.nbytes, entry.length)
                    fh.write(data)
                    x = Extent(PACKED_NAME, data_start + entry.begin, entry.length, entry.dtype, entry.shape,
                               zlib.crc32(data))
                    packed.setdefault(key, []).append(x)
                if progress is not None:
                    progress(done + 1, len(extents))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        torch.set_num_threads(threads)

    linked, copied = _mirror(folder, dest)
    experts = {key: ExpertExtents((gu,), (dn,)) for key, (gu, dn) in packed.items()}
    manifest = Manifest(
        fingerprint(dest, spec, [PACKED_NAME, *referenced_files(extents)]),
        experts,
        source="packed",
        packed_file=PACKED_NAME,
        built=True,
    )
    # The dense weights' checksums too, so that loads of the packed folder verify every tensor.
    manifest = with_tensor_sums(dest, spec, manifest)
    if not write_manifest(dest, manifest):
        raise MoekitError(f"{dest}: cannot write {MANIFEST_NAME} (read-only or permission denied)")
    return PackResult(
        folder=dest,
        path=out,
        manifest=dest / MANIFEST_NAME,
        linked=tuple(linked),
        copied=tuple(copied),
        experts=len(experts),
        layers=len(spec.moe_layers),
        nbytes=out.stat().st_size,
        seconds=time.perf_counter() - start,
        precision=precision,
    )
