"""`moekit-experts.json`: every routed expert's byte extents with a crc32 each, beside the checkpoint.

An expert read from disk is checked against this before any tensor is built from it, so a file
that changed (a re-download, a truncated copy, a flipped bit) is an error naming the expert, never
wrong weights. The manifest is built once by reading every expert (streaming, a progress callback
per expert) and written atomically (tmp + os.replace) beside config.json; nothing else in the
folder is touched. A read-only folder keeps it in memory (`Manifest.on_disk` is False).

A fingerprint ties it to one model: model_type, layer and expert counts, the sha256 of
config.json's bytes and the size of every weight file it depends on. `source` says whether the
extents point into the checkpoint's own safetensors or into a packed file (`moekit pack`).
No torch.
"""

from __future__ import annotations

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
from moekit.offload.extents import (
    ITEMSIZE,
    LAYOUTS,
    Extent,
    ExpertExtents,
    ExtentMap,
    expert_extents,
    referenced_files,
)
from moekit.spec.model_spec import ModelSpec

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
class Manifest:
    fingerprint: Fingerprint
    experts: ExtentMap  # every extent carries its crc32
    source: Source = "checkpoint"
    packed_file: Optional[str] = None  # relative to the folder (absolute when packed elsewhere)
    on_disk: bool = False  # False: the folder was read-only, this manifest lives in memory only
    built: bool = False  # True: checksummed by this call; False: read from moekit-experts.json


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


def build_manifest(folder: str | Path, spec: ModelSpec, progress: Optional[Progress] = None) -> Manifest:
    """Checksum every routed expert where the checkpoint keeps it (not written anywhere)."""
    folder = Path(folder)
    require_moe(spec, folder)
    extents = checksum(folder, expert_extents(folder, spec), progress)
    return Manifest(fingerprint(folder, spec, referenced_files(extents)), extents, built=True)


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
        if not gate_up or len(down) != 1 or (item["layout"] == "interleaved_transposed" and len(gate_up) != 1):
            raise ValueError(f"layer {item['layer']} expert {item['expert']}: wrong number of extents")
        experts[int(item["layer"]), int(item["expert"])] = ExpertExtents(gate_up, down, item["layout"])
    source = data["source"]
    if source not in ("checkpoint", "packed"):
        raise ValueError(f"unknown source {source!r}")
    packed = data.get("packed_file")
    if source == "packed" and not isinstance(packed, str):
        raise ValueError("a packed manifest without its packed file")
    return Manifest(fingerprint_, experts, source, packed, on_disk=True)


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


def check_fingerprint(folder: str | Path, spec: ModelSpec, manifest: Manifest) -> None:
    """A MoekitError when the manifest is for another model or a file it depends on changed size."""
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
    if set(manifest.experts) != expected:
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
