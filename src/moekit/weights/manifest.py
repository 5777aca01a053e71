"""`moekit-experts.json`: every routed expert's byte extents with a crc32 each, beside the checkpoint.

An expert read from disk is checked against this before any tensor is built from it, so a file
that changed (a re-download, a truncated copy, a flipped bit) is an error naming the expert, never
wrong weights. The manifest is built once by reading every expert (streaming, a progress callback
per expert) and written atomically (tmp + os.replace) beside config.json; nothing else in the
folder is touched. A read-only folder keeps it in memory (`Manifest.on_disk` is False).

A fingerprint ties it to one model: model_type, layer and expert counts, the sha256 of
config.json's bytes and the size of every weight file it depends on. `source` says whether the
extents point into the checkpoint's own safetensors or into a packed file (`moekit pack`).

`tensors` adds a crc32 of every other tensor of the checkpoint's safetensors (attention, norms,
embeddings, routers, shared experts; in a packed folder also the original expert tensors), whole
tensor by whole tensor, so the resident load (Checkpoint.get, moekit.weights.integrity) verifies
everything it reads and the paged load its dense weights. It is an optional key of the same format
version: an older moekit ignores it, and a manifest without it (an older moekit's, or `moekit
pack`'s) verifies the routed experts only; `moekit checksum` adds it. A family or format whose
experts the store cannot page yet (no extents) gets a manifest of whole-tensor checksums only.

Who writes it: the first paged run (`--expert-memory`), `moekit pack`, and `moekit checksum`. The
resident load does not build one on first use: it would read every weight twice on a path that
never needed a manifest before; it verifies when one is there.
No torch.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import json
import math
import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Literal, Optional

from moekit.errors import CheckpointError, MoekitError
from moekit.weights.extents import (
    ITEMSIZE,
    LAYOUTS,
    Extent,
    ExpertExtents,
    ExtentMap,
    expert_extents,
    extent_counts_fit,
    referenced_files,
    weight_files,
)
from moekit.spec.model_spec import ModelSpec
from moekit.weights.checkpoint import read_header
from moekit.weights.integrity import RangeCheck

MANIFEST_NAME = "moekit-experts.json"
FORMAT = "moekit-experts"
VERSION = 1
CHUNK = 64 * 1024 * 1024  # crc32 in pieces: a huge expert never needs one huge buffer

Progress = Callable[[int, int], None]  # (experts done, experts in all)
Source = Literal["checkpoint", "packed"]


@dataclass(frozen=True)
class Fingerprint:
    model_type: str
    num_layers: int
    num_experts: int
    config_sha256: str
    file_sizes: tuple[tuple[str, int], ...]  # every weight file the extents depend on


@dataclass(frozen=True)
class TensorSum:
    """A whole tensor's bytes in a safetensors file and their crc32."""

    name: str
    file: str  # relative to the folder
    offset: int  # absolute byte offset in the file
    length: int
    crc32: int


@dataclass(frozen=True)
class Manifest:
    fingerprint: Fingerprint
    experts: ExtentMap  # every extent carries its crc32
    source: Source = "checkpoint"
    packed_file: Optional[str] = None  # relative to the folder (absolute when packed elsewhere)
    on_disk: bool = False  # False: the folder was read-only, this manifest lives in memory only
    built: bool = False  # True: checksummed by this call; False: read from moekit-experts.json
    # Every tensor the expert extents do not cover; None: a manifest without them (see the docstring).
    tensors: Optional[tuple[TensorSum, ...]] = None


def require_moe(spec: ModelSpec, folder: Path) -> None:
    if not spec.moe_layers:
        raise MoekitError(
            f"{folder}: {spec.model_type} has no MoE layers, so it has no routed experts to offload or pack"
        )


def num_experts(spec: ModelSpec) -> int:
    return max((spec.layers[i].ffn.num_experts for i in spec.moe_layers), default=0)  # type: ignore[union-attr]


def fingerprint(folder: Path, spec: ModelSpec, files: list[str]) -> Fingerprint:
    config = (folder / "config.json").read_bytes()
    sizes = tuple((f, (folder / f).stat().st_size) for f in sorted(set(files)))
    return Fingerprint(
        model_type=spec.model_type,
        num_layers=spec.num_layers,
        num_experts=num_experts(spec),
        config_sha256=hashlib.sha256(config).hexdigest(),
        file_sizes=sizes,
    )


def _crc(fd: int, x: Extent, path: Path) -> int:
    crc, done = 0, 0
    while done < x.length:
        want = min(CHUNK, x.length - done)
        data = os.pread(fd, want, x.offset + done)
        if len(data) < want:
            raise CheckpointError(f"{path}: truncated (bytes {x.offset}..{x.end} of an expert run past its end)")
        crc = zlib.crc32(data, crc)
        done += want
    return crc


def checksum(folder: Path, extents: ExtentMap, progress: Optional[Progress] = None) -> ExtentMap:
    """The same extents with their crc32s, reading every expert once in file order."""
    fds = {f: os.open(folder / f, os.O_RDONLY) for f in referenced_files(extents)}
    out: ExtentMap = {}
    in_file_order = sorted(extents.items(), key=lambda kv: min((x.file, x.offset) for x in kv[1].extents))
    try:
        for done, (key, ex) in enumerate(in_file_order):
            with_crc = [replace(x, crc32=_crc(fds[x.file], x, folder / x.file)) for x in ex.extents]
            n = len(ex.gate_up)
            out[key] = replace(ex, gate_up=tuple(with_crc[:n]), down=tuple(with_crc[n:]))
            if progress is not None:
                progress(done + 1, len(extents))
    finally:
        for fd in fds.values():
            os.close(fd)
    return dict(sorted(out.items()))


def _placements(folder: Path) -> list[tuple[str, str, int, int]]:
    """(name, file, absolute offset, length) of every tensor of the checkpoint's safetensors, in file order."""
    where = weight_files(folder)
    out = []
    for file in sorted(set(where.values())):
        header = read_header(folder / file)
        for name, meta in header.tensors.items():
            if where.get(name) == file:
                begin, end = meta["data_offsets"]
                out.append((name, file, header.data_start + begin, end - begin))
    return sorted(out, key=lambda p: (p[1], p[2]))


def _uncovered(folder: Path, extents: ExtentMap) -> list[tuple[str, str, int, int]]:
    """The tensors no expert extent covers: extents are whole tensors or rows of a stacked one and
    never overlap, so a tensor is covered when the extents starting inside it add up to its length."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for ex in extents.values():
        for x in ex.extents:
            by_file.setdefault(x.file, []).append((x.offset, x.length))
    starts, prefix = {}, {}
    for file, row in by_file.items():
        row.sort()
        starts[file] = [o for o, _ in row]
        prefix[file] = [0]
        for _, n in row:
            prefix[file].append(prefix[file][-1] + n)
    out = []
    for name, file, offset, length in _placements(folder):
        inside = 0
        if file in starts:
            lo = bisect.bisect_left(starts[file], offset)
            hi = bisect.bisect_left(starts[file], offset + length)
            inside = prefix[file][hi] - prefix[file][lo]
        if length == 0 or inside < length:
            out.append((name, file, offset, length))
    return out


def tensor_sums(folder: Path, extents: ExtentMap, progress: Optional[Progress] = None) -> tuple[TensorSum, ...]:
    """A crc32 of every tensor the expert extents do not cover, reading each once in file order."""
    todo = _uncovered(folder, extents)
    fds = {f: os.open(folder / f, os.O_RDONLY) for f in sorted({t[1] for t in todo})}
    out = []
    try:
        for done, (name, file, offset, length) in enumerate(todo):
            crc = _crc(fds[file], Extent(file, offset, length, "U8", (length,)), folder / file)
            out.append(TensorSum(name, file, offset, length, crc))
            if progress is not None:
                progress(done + 1, len(todo))
    finally:
        for fd in fds.values():
            os.close(fd)
    return tuple(out)


def _fingerprint_of(folder: Path, spec: ModelSpec, extents: ExtentMap, tensors) -> Fingerprint:
    return fingerprint(folder, spec, referenced_files(extents) + [t.file for t in tensors or ()])


def build_manifest(
    folder: str | Path, spec: ModelSpec, progress: Optional[Progress] = None, tensor_progress: Optional[Progress] = None
) -> Manifest:
    """Checksum every routed expert where the checkpoint keeps it, and every other tensor (not written anywhere)."""
    folder = Path(folder)
    require_moe(spec, folder)
    extents = checksum(folder, expert_extents(folder, spec, published=True), progress)
    tensors = tensor_sums(folder, extents, tensor_progress)
    return Manifest(_fingerprint_of(folder, spec, extents, tensors), extents, built=True, tensors=tensors)


def build_whole_tensor_manifest(folder: str | Path, spec: ModelSpec, progress: Optional[Progress] = None) -> Manifest:
    """Whole-tensor checksums only, no expert extents: for a family or format whose experts the
    store cannot page yet (the resident load still verifies every tensor it reads)."""
    folder = Path(folder)
    tensors = tensor_sums(folder, {}, progress)
    return Manifest(_fingerprint_of(folder, spec, {}, tensors), {}, built=True, tensors=tensors)


def with_tensor_sums(folder: str | Path, spec: ModelSpec, manifest: Manifest, progress: Optional[Progress] = None) -> Manifest:
    """`manifest` (one without `tensors`) with a crc32 of every tensor its experts do not cover."""
    folder = Path(folder)
    tensors = tensor_sums(folder, manifest.experts, progress)
    files = [f for f, _ in manifest.fingerprint.file_sizes] + [t.file for t in tensors]
    return replace(manifest, fingerprint=fingerprint(folder, spec, files), tensors=tensors, built=True)


# --- checks: what a reader verifies ------------------------------------------------------------

CHANGED = f"the file changed since {MANIFEST_NAME} was written; re-download it, or delete {MANIFEST_NAME} if the change is yours"

Placements = dict[str, tuple[str, int, int]]  # tensor name → (file, absolute offset, length)


def tensor_checks(folder: Path, manifest: Manifest, placements: Placements) -> dict[str, tuple[RangeCheck, ...]]:
    """Each tensor's checks, offsets relative to its first byte: its own crc32 (`tensors`) and the
    expert extents that lie inside it (a per-expert tensor, or one expert's rows of a stacked one).
    Extents in a file the reader does not read (a packed file, for the resident load) are left out."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for name, (file, offset, length) in placements.items():
        spans.setdefault(file, []).append((offset, offset + length, name))
    for file in spans:
        spans[file].sort()
    starts = {file: [s[0] for s in row] for file, row in spans.items()}
    checks: dict[str, list[RangeCheck]] = {}
    for (layer, e), ex in sorted(manifest.experts.items()):
        for x in ex.extents:
            if x.file not in spans or x.crc32 is None:
                continue
            i = bisect.bisect_right(starts[x.file], x.offset) - 1  # the last tensor starting at or before it
            if i >= 0 and x.end <= spans[x.file][i][1]:
                start, _, name = spans[x.file][i]
                what = f"layer {layer} expert {e} (tensor {name})"
                checks.setdefault(name, []).append(RangeCheck(x.offset - start, x.length, x.crc32, what))
            # else: the extent is in no tensor the reader reads (a packed file, for the resident load)
    for t in manifest.tensors or ():
        if t.name not in placements:
            continue  # the loader refuses a missing tensor itself, in its own words
        if placements[t.name] != (t.file, t.offset, t.length):
            raise MoekitError(f"{folder}: tensor {t.name} is not where {MANIFEST_NAME} says it is; {CHANGED}")
        checks.setdefault(t.name, []).append(RangeCheck(0, t.length, t.crc32, f"tensor {t.name}"))
    return {name: tuple(sorted(c, key=lambda r: r.offset)) for name, c in checks.items()}


def verify_all(folder: str | Path, manifest: Manifest, progress: Optional[Progress] = None) -> int:
    """Read every range the manifest checksums and check it (`moekit checksum` on a complete
    manifest); one CheckpointError line on the first mismatch. Returns the bytes checked."""
    folder = Path(folder)
    ranges = [(x, f"layer {layer} expert {e}") for (layer, e), ex in sorted(manifest.experts.items()) for x in ex.extents]
    ranges += [(Extent(t.file, t.offset, t.length, "U8", (t.length,), t.crc32), f"tensor {t.name}")
               for t in manifest.tensors or ()]
    ranges.sort(key=lambda r: (r[0].file, r[0].offset))
    fds = {f: os.open(folder / f, os.O_RDONLY) for f in sorted({x.file for x, _ in ranges})}
    try:
        for done, (x, what) in enumerate(ranges):
            if x.crc32 is not None and _crc(fds[x.file], x, folder / x.file) != x.crc32:
                raise CheckpointError(f"{folder}: {what}: checksum mismatch in {x.file} (bytes {x.offset}..{x.end}); {CHANGED}")
            if progress is not None:
                progress(done + 1, len(ranges))
    finally:
        for fd in fds.values():
            os.close(fd)
    return sum(x.length for x, _ in ranges)


# --- JSON ------------------------------------------------------------------------------------


def _extent_json(x: Extent) -> list:
    return [x.file, x.offset, x.length, x.dtype, list(x.shape), x.crc32]


def to_json(m: Manifest) -> dict:
    fp = m.fingerprint
    return {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": {
            "model_type": fp.model_type,
            "num_layers": fp.num_layers,
            "num_experts": fp.num_experts,
            "config_sha256": fp.config_sha256,
            "file_sizes": dict(fp.file_sizes),
        },
        "source": m.source,
        "packed_file": m.packed_file,
        # tensor: [name, file, offset, length, crc32]; absent in a manifest without them
        **({} if m.tensors is None else {"tensors": [[t.name, t.file, t.offset, t.length, t.crc32] for t in m.tensors]}),
        # extent: [file, offset, length, dtype, shape, crc32]
        "experts": [
            {
                "layer": layer,
                "expert": e,
                "layout": ex.layout,
                "gate_up": [_extent_json(x) for x in ex.gate_up],
                "down": [_extent_json(x) for x in ex.down],
            }
            for (layer, e), ex in sorted(m.experts.items())
        ],
    }


def _extent(row) -> Extent:
    file, offset, length, dtype, shape, crc = row
    if not (isinstance(file, str) and isinstance(offset, int) and isinstance(length, int) and isinstance(crc, int)):
        raise ValueError("bad extent")
    if dtype not in ITEMSIZE or length != ITEMSIZE[dtype] * math.prod(int(s) for s in shape) or offset < 0:
        raise ValueError("bad extent")
    return Extent(file, offset, length, dtype, tuple(int(s) for s in shape), crc)


def from_json(data: dict) -> Manifest:
    """Raises ValueError / KeyError / TypeError on anything malformed (the caller words it)."""
    if data.get("format") != FORMAT:
        raise ValueError("not a moekit-experts manifest")
    if data.get("version") != VERSION:
        raise ValueError(f"format version {data.get('version')}, this moekit reads version {VERSION}")
    fp = data["fingerprint"]
    fingerprint_ = Fingerprint(
        model_type=str(fp["model_type"]),
        num_layers=int(fp["num_layers"]),
        num_experts=int(fp["num_experts"]),
        config_sha256=str(fp["config_sha256"]),
        file_sizes=tuple(sorted((str(k), int(v)) for k, v in fp["file_sizes"].items())),
    )
    experts: ExtentMap = {}
    for item in data["experts"]:
        if item["layout"] not in LAYOUTS:
            raise ValueError(f"unknown layout {item['layout']!r}")
        gate_up = tuple(_extent(r) for r in item["gate_up"])
        down = tuple(_extent(r) for r in item["down"])
        if not extent_counts_fit(item["layout"], len(gate_up), len(down)):
            raise ValueError(f"layer {item['layer']} expert {item['expert']}: wrong number of extents")
        experts[int(item["layer"]), int(item["expert"])] = ExpertExtents(gate_up, down, item["layout"])
    source = data["source"]
    if source not in ("checkpoint", "packed"):
        raise ValueError(f"unknown source {source!r}")
    packed = data.get("packed_file")
    if source == "packed" and not isinstance(packed, str):
        raise ValueError("a packed manifest without its packed file")
    tensors = None if data.get("tensors") is None else tuple(_tensor_sum(r) for r in data["tensors"])
    return Manifest(fingerprint_, experts, source, packed, on_disk=True, tensors=tensors)


def _tensor_sum(row) -> TensorSum:
    name, file, offset, length, crc = row
    if not (isinstance(name, str) and isinstance(file, str) and all(isinstance(v, int) for v in (offset, length, crc))):
        raise ValueError("bad tensor checksum")
    if offset < 0 or length < 0:
        raise ValueError("bad tensor checksum")
    return TensorSum(name, file, offset, length, crc)


def read_manifest(folder: str | Path) -> Optional[Manifest]:
    """The manifest beside the checkpoint, None when there is none."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise MoekitError(f"{path}: cannot read ({err.strerror})") from None
    try:
        return from_json(json.loads(raw))
    except (UnicodeDecodeError, json.JSONDecodeError):
        why = "not JSON"
    except ValueError as err:
        why = str(err)
    except (KeyError, TypeError, AttributeError):
        why = "malformed"
    raise MoekitError(f"{path}: not a valid manifest ({why}); delete it and moekit rebuilds it")


def write_atomically(path: Path, data: bytes) -> bool:
    """Write `path` via a temporary file in the same folder and os.replace. False when the folder
    is not writable (read-only mount, permissions); nothing is left behind either way."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as err:
        if err.errno in (errno.EROFS, errno.EPERM, errno.EACCES):
            return False
        raise
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


def write_manifest(folder: str | Path, manifest: Manifest) -> bool:
    """Write moekit-experts.json beside the checkpoint; False when the folder is read-only."""
    data = json.dumps(to_json(manifest), separators=(",", ":")).encode()
    return write_atomically(Path(folder) / MANIFEST_NAME, data)


# --- fingerprint check -------------------------------------------------------------------------

_FIX = f"re-run `moekit pack` or delete {MANIFEST_NAME}"


def check_fingerprint(folder: str | Path, spec: ModelSpec, manifest: Manifest, require_experts: bool = True) -> None:
    """A MoekitError when the manifest is for another model or a file it depends on changed size.
    require_experts False accepts a whole-tensor manifest (no expert extents): the resident load's check."""
    folder = Path(folder)
    want = fingerprint(folder, spec, [])
    got = manifest.fingerprint
    ours = (want.model_type, want.num_layers, want.num_experts, want.config_sha256)
    if ours != (got.model_type, got.num_layers, got.num_experts, got.config_sha256):
        what = f"{got.model_type}, {got.num_layers} layers, {got.num_experts} experts"
        if ours[:3] == (got.model_type, got.num_layers, got.num_experts):
            what += ", a different config.json"
        raise MoekitError(
            f"{folder / MANIFEST_NAME} was written for another model ({what}); delete it and moekit rebuilds it"
        )
    widths = {layer: spec.layers[layer].ffn.num_experts for layer in spec.moe_layers}  # type: ignore[union-attr]
    expected = {(layer, e) for layer, n in widths.items() for e in range(n)}
    whole_tensors = not require_experts and not manifest.experts and manifest.tensors is not None
    if set(manifest.experts) != expected and not whole_tensors:
        raise MoekitError(
            f"{folder / MANIFEST_NAME} does not list this model's experts; delete it and moekit rebuilds it"
        )
    for file, size in got.file_sizes:
        path = folder / file
        if not path.is_file():
            if manifest.source == "packed" and file == manifest.packed_file:
                raise MoekitError(f"packed file {file} listed in {MANIFEST_NAME} is missing; re-run moekit pack")
            raise MoekitError(f"{folder}: {file} listed in {MANIFEST_NAME} is missing")
        now = path.stat().st_size
        if now != size:
            raise MoekitError(
                f"{path} changed size since {MANIFEST_NAME} was written ({size} → {now} bytes); {_FIX}"
            )


def load_or_build_manifest(folder: str | Path, spec: ModelSpec, progress: Optional[Progress] = None) -> Manifest:
    """The checked manifest beside the checkpoint, or a new one (checksumming every expert once),
    written there when the folder is writable."""
    folder = Path(folder)
    require_moe(spec, folder)
    found = read_manifest(folder)
    if found is not None:
        check_fingerprint(folder, spec, found)
        return found
    built = build_manifest(folder, spec, progress)
    return replace(built, on_disk=write_manifest(folder, built))


# --- `moekit checksum` -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChecksumResult:
    action: Literal["wrote", "added", "verified"]  # a new manifest; tensors added to an old one; checked
    path: Path
    experts: int  # routed experts with extents (0: whole-tensor checksums only)
    tensors: int  # other tensors checksummed whole
    nbytes: int  # bytes read
    seconds: float
    note: Optional[str] = None  # why the experts have no extents, when they have none


def checksum_checkpoint(folder: str | Path, spec: ModelSpec, progress: Optional[Progress] = None) -> ChecksumResult:
    """What `moekit checksum` does: write moekit-experts.json when there is none; add the other
    tensors' checksums to one without them; else check every byte it checksums. Only the manifest
    is ever written; a read-only folder is an error (the resident load builds nothing)."""
    import time

    start = time.perf_counter()
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    found = read_manifest(folder)
    note = None
    if found is not None:
        check_fingerprint(folder, spec, found, require_experts=False)
        if found.tensors is not None:
            nbytes = verify_all(folder, found, progress)
            return ChecksumResult("verified", path, len(found.experts), len(found.tensors), nbytes,
                                  time.perf_counter() - start)
        manifest, action = with_tensor_sums(folder, spec, found, progress), "added"
        nbytes = sum(t.length for t in manifest.tensors or ())
    else:
        try:
            require_moe(spec, folder)
            extents = expert_extents(folder, spec, published=True)
        except MoekitError as err:  # the store cannot page these experts: whole tensors, still checked
            note, extents = str(err), None
        if extents is None:
            manifest = build_whole_tensor_manifest(folder, spec, progress)
        else:
            manifest = build_manifest(folder, spec, progress, tensor_progress=progress)
        action = "wrote"
        nbytes = sum(ex.nbytes for ex in manifest.experts.values()) + sum(t.length for t in manifest.tensors or ())
    if not write_manifest(folder, manifest):
        raise MoekitError(f"{folder}: cannot write {MANIFEST_NAME} here (read-only or permission denied)")
    return ChecksumResult(action, path, len(manifest.experts), len(manifest.tensors or ()), nbytes,
                          time.perf_counter() - start, note)
