"""A GGUF's routed experts for the expert store, and the GGUF's checksum manifest.

llama.cpp's converter stacks each layer's experts: blk.N.ffn_{gate,up}_exps.weight [E, F, D] and
blk.N.ffn_down_exps.weight [E, D, F] (torch order, ggml's `ne` reversed), so expert e's slice of
each is one contiguous byte range: gate and up are the two extents of a "rows" expert, down the
third (moekit.weights.extents). The bytes stay as stored:

  F32, F16, BF16  cast on load to the engine dtype, as the resident load casts them
  Q8_0, Q4_0      ggml's block_q8_0 / block_q4_0 (a float16 scale, then 32 int8 / 16 bytes of
                  nibbles, low nibble element j, high nibble j + 16): byte for byte the layout of
                  moekit's int8 / int4 kernels (moekit.model.int8, int4), so an expert is multiplied
                  as read; its extents' shapes count bytes, [out, nb * block bytes], as a packed file's
  Q4_K, Q6_K      no kernel reads these: each slot holds the expert dequantized at the engine
                  dtype (moekit.offload.reader, gguf-py's own dequantization, the function the
                  resident load uses, so paged and resident weights are the same values); a miss
                  reads the K-quant bytes (4.5 / 6.56 bits a weight) and pays the dequantization
  MXFP4           gpt-oss's experts (ggml's block: the E8M0 scale, then 16 bytes of FP4 codes):
                  layout "gguf_mxfp4", kind "MXFP4"; a slot holds the packed kernels' prepared rows
                  [out, G · 17], the same 17 bytes with the code nibbles reordered as read
                  (moekit.weights.gguf_mxfp4), gate's slice then up's: 4.25 bits a weight, held
                  and read, and the kernels and PackedFormat of the resident load

An expert whose gate/up and down are of different kinds (a block format and a float: the converter
keeps rows that are not whole blocks at F16) is refused: the store runs one kind per expert. Floats
and K-quants mix freely (a Q4_K_M file's Q4_K gate/up and Q6_K down): both are held as floats.

The manifest: `model.gguf.moekit-experts.json` beside the file (the .gguf is never written), in
moekit-experts.json's format (moekit.weights.manifest): a crc32 per expert extent and per other
tensor, so every byte of tensor data is covered. Its fingerprint's config_sha256 is the sha256 of
the GGUF's header (metadata and tensor table, everything before the data): a GGUF re-converted or
re-quantized has another header. In the JSON an extent's file is the GGUF's name; read back it is
the GGUF's absolute path, which the reader opens whatever folder it is handed. A GGUF whose experts
cannot be paged gets whole-tensor checksums only (the resident load still verifies every byte).

Who writes it: `moekit checksum x.gguf`, nobody else. The paged load needs no manifest to know
where experts are (the header says), so without one it pages unverified and says so, rather than
reading every expert once on a first run as the safetensors store must.
No torch.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional

from moekit.errors import CheckpointError, MoekitError
from moekit.weights.extents import DEQUANTIZED, Extent, ExpertExtents, ExtentMap
from moekit.weights.manifest import (
    ChecksumResult,
    Fingerprint,
    Manifest,
    Progress,
    TensorSum,
    from_json,
    num_experts,
    to_json,
    write_atomically,
)
from moekit.spec.model_spec import ModelSpec
from moekit.weights.gguf_file import GGUFFile, GGUFTensor
from moekit.weights.integrity import RangeCheck

SUFFIX = ".moekit-experts.json"
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = ("Q8_0", "Q4_0")  # ggml's blocks that are moekit's int8 / int4 kernel layout
DEQUANTIZED_TYPES = tuple(DEQUANTIZED)  # K-quants: dequantized as they are read, held at the engine dtype
MXFP4 = "MXFP4"  # gpt-oss's experts: kept packed, as the packed kernels' prepared rows
PAGED_TYPES = FLOAT_TYPES + BLOCK_TYPES + DEQUANTIZED_TYPES + (MXFP4,)
STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate, up, down: ExpertExtents order
CHUNK = 64 * 1024 * 1024  # crc32 in pieces: a huge tensor never needs one huge buffer


def manifest_path(gguf_path: Path) -> Path:
    return gguf_path.with_name(gguf_path.name + SUFFIX)


def changed(gguf_path: Path) -> str:
    """What to do when a checked byte differs (the end of every mismatch line)."""
    return (f"the file changed since {manifest_path(gguf_path).name} was written; re-download it, or delete "
            f"{manifest_path(gguf_path).name} if the change is yours")


# --- where each expert is ----------------------------------------------------------------------


def _slice(t: GGUFTensor, e: int, file: str) -> Extent:
    """Slice e of a stacked [E, rows, cols] tensor: contiguous, one extent. A float's shape counts
    elements; any other type's counts bytes per row ([rows, row bytes], t.data's own shape)."""
    length = t.n_bytes // t.shape[0]
    shape = tuple(t.shape[1:]) if t.qtype in FLOAT_TYPES else tuple(t.data.shape[1:])
    return Extent(file, t.offset + e * length, length, t.qtype, shape)


def _stacked(gguf: GGUFFile, spec: ModelSpec) -> dict[int, tuple[GGUFTensor, GGUFTensor, GGUFTensor]]:
    """MoE layer → its (gate, up, down) stacked tensors, shapes checked against the spec."""
    out = {}
    for layer in spec.moe_layers:
        moe = spec.layers[layer].ffn
        n, f, d = moe.num_experts, moe.expert.width, moe.expert.hidden_size  # type: ignore[union-attr]
        parts = []
        for part, shape in zip(STACKED, ((n, f, d), (n, f, d), (n, d, f))):
            name = f"blk.{layer}.{part}.weight"
            t = gguf.tensors.get(name)
            if t is None:
                raise CheckpointError(f"{gguf.path}: GGUF has no {name} (layer {layer}'s routed experts)")
            if t.shape != shape:
                raise CheckpointError(f"{gguf.path}: GGUF tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
            parts.append(t)
        out[layer] = tuple(parts)
    return out


def _extents(gguf: GGUFFile, spec: ModelSpec, file: str) -> ExtentMap:
    return {
        (layer, e): ExpertExtents((_slice(gate, e, file), _slice(up, e, file)), (_slice(down, e, file),),
                                  "gguf_mxfp4" if gate.qtype == MXFP4 else "rows")
        for layer, (gate, up, down) in _stacked(gguf, spec).items()
        for e in range(gate.shape[0])
    }


def unpageable(gguf: GGUFFile, spec: ModelSpec) -> Optional[str]:
    """Why the store cannot page this GGUF's experts (one line), None when it can."""
    for layer, parts in _stacked(gguf, spec).items():
        for t in parts:
            if t.qtype not in PAGED_TYPES:
                return (f"{gguf.path}: {t.name} is {t.qtype}, which the expert store does not page "
                        f"(it pages {', '.join(PAGED_TYPES)} experts)")
        kinds = [t.qtype in BLOCK_TYPES + (MXFP4,) and t.qtype for t in parts]
        if MXFP4 in kinds and spec.model_type != "gpt_oss":  # only gpt-oss's kernels read MXFP4 experts
            return (f"{gguf.path}: {parts[kinds.index(MXFP4)].name} is MXFP4, which the expert store pages "
                    f"for gpt-oss only (this is {spec.model_type})")
        if len(set(kinds)) > 1:
            types = ", ".join(f"{part.split('_')[1]} {t.qtype}" for part, t in zip(STACKED, parts))
            return (f"{gguf.path}: layer {layer}'s experts mix types ({types}); the expert store pages an expert "
                    "stored in one block format or in floats only")
    return None


def expert_extents(gguf: GGUFFile, spec: ModelSpec) -> ExtentMap:
    """(layer, expert) → where its gate, up and down slices are in the GGUF (no crc32s); a
    CheckpointError when the store cannot page them."""
    why = unpageable(gguf, spec)
    if why is not None:
        raise CheckpointError(f"{why}; run it without --expert-memory")
    return _extents(gguf, spec, str(Path(gguf.path).resolve()))


# --- the manifest ------------------------------------------------------------------------------


def header_sha256(gguf: GGUFFile) -> str:
    with open(gguf.path, "rb") as fh:
        return hashlib.sha256(fh.read(gguf.data_start)).hexdigest()


def fingerprint(gguf: GGUFFile, spec: ModelSpec) -> Fingerprint:
    path = Path(gguf.path)
    return Fingerprint(spec.model_type, spec.num_layers, num_experts(spec), header_sha256(gguf),
                       ((path.name, path.stat().st_size),))


def _crcs(path: Path, ranges: list[tuple[int, int]], progress: Optional[Progress] = None) -> list[int]:
    """crc32 of each (offset, length) of `path`, read once in file order."""
    out = [0] * len(ranges)
    fd = os.open(path, os.O_RDONLY)
    try:
        for done, i in enumerate(sorted(range(len(ranges)), key=lambda i: ranges[i])):
            offset, length = ranges[i]
            crc, at = 0, 0
            while at < length:
                data = os.pread(fd, min(CHUNK, length - at), offset + at)
                if not data:
                    raise CheckpointError(f"{path}: truncated (bytes {offset}..{offset + length} run past its end)")
                crc, at = zlib.crc32(data, crc), at + len(data)
            out[i] = crc
            if progress is not None:
                progress(done + 1, len(ranges))
    finally:
        os.close(fd)
    return out


def build(gguf: GGUFFile, spec: ModelSpec, progress: Optional[Progress] = None) -> tuple[Manifest, Optional[str]]:
    """Checksum every expert extent (when the store can page them) and every other tensor.
    Returns the manifest (files named by the GGUF's name, as written) and why the experts have no
    extents, when they have none."""
    path = Path(gguf.path)
    note = unpageable(gguf, spec)
    experts = {} if note is not None else _extents(gguf, spec, path.name)
    covered = {f"blk.{layer}.{part}.weight" for layer, _ in experts for part in STACKED}
    others = [t for t in gguf.tensors.values() if t.name not in covered]
    extents = [x for _, ex in sorted(experts.items()) for x in ex.extents]
    crcs = _crcs(path, [(x.offset, x.length) for x in extents] + [(t.offset, t.n_bytes) for t in others], progress)
    with_crc = iter(replace(x, crc32=c) for x, c in zip(extents, crcs))
    experts = {key: replace(ex, gate_up=tuple(next(with_crc) for _ in ex.gate_up),
                            down=tuple(next(with_crc) for _ in ex.down))
               for key, ex in sorted(experts.items())}
    tensors = tuple(TensorSum(t.name, path.name, t.offset, t.n_bytes, c) for t, c in zip(others, crcs[len(extents):]))
    return Manifest(fingerprint(gguf, spec), experts, built=True, tensors=tensors), note


def _rebase(manifest: Manifest, file: str) -> Manifest:
    """Every extent and tensor sum of the manifest in `file` (the GGUF's absolute path)."""
    experts = {key: replace(ex, gate_up=tuple(replace(x, file=file) for x in ex.gate_up),
                            down=tuple(replace(x, file=file) for x in ex.down))
               for key, ex in manifest.experts.items()}
    tensors = tuple(replace(t, file=file) for t in manifest.tensors or ())
    return replace(manifest, experts=experts, tensors=tensors)


def read(gguf: GGUFFile, spec: ModelSpec) -> Optional[Manifest]:
    """The manifest beside the GGUF, checked to be this GGUF's; None when there is none.
    Its files are the GGUF's absolute path."""
    path = Path(gguf.path)
    where = manifest_path(path)
    if not where.is_file():
        return None
    fix = f"delete it and run `moekit checksum {path}`"
    try:
        found = from_json(json.loads(where.read_bytes()))
    except OSError as err:
        raise MoekitError(f"{where}: cannot read ({err.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise MoekitError(f"{where}: not a valid manifest (not JSON); {fix}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise MoekitError(f"{where}: not a valid manifest ({err if isinstance(err, ValueError) else 'malformed'}); {fix}") from None
    want, got = fingerprint(gguf, spec), found.fingerprint
    if (want.model_type, want.num_layers, want.num_experts, want.config_sha256) != \
            (got.model_type, got.num_layers, got.num_experts, got.config_sha256) or found.tensors is None:
        raise MoekitError(f"{where} was written for another GGUF (its header differs from {path.name}'s); {fix}")
    sizes = [size for _, size in got.file_sizes]
    if sizes != [want.file_sizes[0][1]]:
        raise MoekitError(f"{path} changed size since {where.name} was written "
                          f"({sizes[0] if len(sizes) == 1 else sizes} → {want.file_sizes[0][1]} bytes); {fix}")
    return _rebase(found, str(path.resolve()))


def store_manifest(gguf: GGUFFile, spec: ModelSpec, verify: bool) -> tuple[Manifest, list[str]]:
    """What the expert store reads a GGUF's experts through: the header's extents, with the
    manifest's crc32s when there is one and `verify`; the notes to show. Refuses in one line what
    the store cannot page."""
    extents = expert_extents(gguf, spec)
    found = read(gguf, spec) if verify else None
    if found is None:
        # Said because a safetensors store always verifies (its first paged run checksums every expert).
        notes = [] if not verify else [f"routed experts read unverified: no {manifest_path(Path(gguf.path)).name} "
                                       f"(`moekit checksum {gguf.path}` writes one)"]
        return Manifest(fingerprint(gguf, spec), extents), notes
    plain = {key: replace(ex, gate_up=tuple(replace(x, crc32=None) for x in ex.gate_up),
                          down=tuple(replace(x, crc32=None) for x in ex.down)) for key, ex in found.experts.items()}
    if plain != extents:  # the header's sha256 matched, so only a manifest edited by hand gets here
        raise MoekitError(f"{manifest_path(Path(gguf.path))} does not list this GGUF's experts; "
                          f"delete it and run `moekit checksum {gguf.path}`")
    return found, []


def resident_checks(gguf: GGUFFile, manifest: Manifest) -> dict[str, tuple[RangeCheck, ...]]:
    """GGUF tensor name → its checks, offsets relative to the tensor's first byte: its own crc32,
    or one per expert slice of a stacked tensor (what GGUFCheckpoint.get verifies)."""
    by_offset = sorted(gguf.tensors.values(), key=lambda t: t.offset)
    starts = [t.offset for t in by_offset]
    checks: dict[str, list[RangeCheck]] = {}
    for (layer, e), ex in sorted(manifest.experts.items()):
        for x in ex.extents:
            i = bisect.bisect_right(starts, x.offset) - 1
            t = by_offset[i] if i >= 0 else None
            if t is None or x.end > t.offset + t.n_bytes or x.crc32 is None:
                raise MoekitError(f"{manifest_path(Path(gguf.path))} does not list this GGUF's experts; "
                                  f"delete it and run `moekit checksum {gguf.path}`")
            checks.setdefault(t.name, []).append(RangeCheck(x.offset - t.offset, x.length, x.crc32,
                                                            f"layer {layer} expert {e} (tensor {t.name})"))
    for s in manifest.tensors or ():
        t = gguf.tensors.get(s.name)
        if t is None or (t.offset, t.n_bytes) != (s.offset, s.length):
            raise MoekitError(f"{gguf.path}: tensor {s.name} is not where {manifest_path(Path(gguf.path)).name} "
                              f"says it is; delete it and run `moekit checksum {gguf.path}`")
        checks.setdefault(s.name, []).append(RangeCheck(0, s.length, s.crc32, f"tensor {s.name}"))
    return {name: tuple(sorted(c, key=lambda r: r.offset)) for name, c in checks.items()}


def _ranges(manifest: Manifest) -> Iterable[tuple[int, int, int, str]]:
    for (layer, e), ex in sorted(manifest.experts.items()):
        for x in ex.extents:
            yield x.offset, x.length, x.crc32, f"layer {layer} expert {e}"
    for t in manifest.tensors or ():
        yield t.offset, t.length, t.crc32, f"tensor {t.name}"


def checksum_gguf(path: Path, spec: ModelSpec, progress: Optional[Progress] = None) -> ChecksumResult:
    """`moekit checksum x.gguf`: write x.gguf.moekit-experts.json when there is none, else check
    every byte it checksums (one CheckpointError line on the first mismatch) and write nothing."""
    from moekit.weights.gguf_file import read_gguf

    start = time.perf_counter()
    gguf = read_gguf(path)
    where = manifest_path(path)
    found = read(gguf, spec)
    if found is not None:
        ranges = list(_ranges(found))
        crcs = _crcs(path, [(o, n) for o, n, _, _ in ranges], progress)
        for (offset, length, want, what), got in zip(ranges, crcs):
            if got != want:
                raise CheckpointError(f"{path}: {what}: checksum mismatch (bytes {offset}..{offset + length}); {changed(path)}")
        return ChecksumResult("verified", where, len(found.experts), len(found.tensors or ()),
                              sum(n for _, n, _, _ in ranges), time.perf_counter() - start)
    manifest, note = build(gguf, spec, progress)
    data = json.dumps(to_json(manifest), separators=(",", ":")).encode()
    if not write_atomically(where, data):
        raise MoekitError(f"{path.parent}: cannot write {where.name} here (read-only or permission denied)")
    nbytes = sum(ex.nbytes for ex in manifest.experts.values()) + sum(t.length for t in manifest.tensors or ())
    return ChecksumResult("wrote", where, len(manifest.experts), len(manifest.tensors or ()), nbytes,
                          time.perf_counter() - start, note)
