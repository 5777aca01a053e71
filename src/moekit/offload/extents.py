"""Where each routed expert's bytes are: file, byte offset and length, straight from safetensors headers.

An expert store reads one expert with a few `os.pread`s, so it needs absolute byte ranges, not
tensor names. A safetensors file is an 8-byte little-endian header length, a JSON header of
`name → {dtype, shape, data_offsets}` (offsets relative to the end of the header) and the data;
an extent's offset is therefore `8 + header_len + data_offsets[0]` (+ the slice's start when the
expert is one row of a stacked tensor).

Our layout of one expert (moekit.model.experts): gate_up [rows, D] with gate rows then up rows
(rows = 2F gated, F plain) and down [D, F]. How the stored pieces become it is the `layout`:

  "rows"                    the extents of a part, stacked row-wise, ARE our layout
                            (per-expert gate/up/down tensors; granitemoe's row e of [E, 2F, D];
                            a packed file, whose int8/int4 experts are Q8_0/Q4_0 block bytes
                            [out, nb * block bytes]: moekit.offload.precision)
  "interleaved_transposed"  gpt_oss: gate_up is slice e of [E, D, 2F] with gate at even and up at
                            odd columns, down is slice e of [E, F, D] (x @ W): both transposed
  "transposed"              llama4: as gpt_oss, but gate_up's gate is its first half, up its second

Only routed-expert weights live here: biases, routers and shared experts stay resident.
No torch: the manifest (and `moekit pack`'s planning) use this on machines without it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from moekit.errors import CheckpointError
from moekit.weights.checkpoint import Header, read_header
from moekit.model.hub_names import hub_names
from moekit.spec.model_spec import ModelSpec, MoESpec

Layout = Literal["rows", "interleaved_transposed", "transposed"]
LAYOUTS: tuple[str, ...] = ("rows", "interleaved_transposed", "transposed")

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PACKED_NAME = "experts.packed.safetensors"

# Bytes per element of the safetensors dtypes an expert may be stored in (a float the engine can
# cast from exactly as loading.py's copy_ does).
FLOATS: dict[str, int] = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
# ... and in a packed file, the block formats of moekit.offload.precision: their extents' shapes
# count bytes ([out, nb * block bytes]), so one "element" is a byte.
ITEMSIZE: dict[str, int] = {**FLOATS, "Q8_0": 1, "Q4_0": 1}



@dataclass(frozen=True)
class Extent:
    file: str  # relative to the checkpoint folder (absolute for a packed file kept elsewhere)
    offset: int  # absolute byte offset in the file
    length: int  # bytes
    dtype: str  # safetensors dtype, e.g. "BF16"
    shape: tuple[int, ...]  # of the bytes as stored (one expert's slice of a stacked tensor)
    crc32: Optional[int] = None  # zlib.crc32 of the bytes; set by the manifest

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ExpertExtents:
    """One expert's bytes: gate_up and down, each one or more extents, and how they become ours."""

    gate_up: tuple[Extent, ...]
    down: tuple[Extent, ...]
    layout: Layout = "rows"

    @property
    def extents(self) -> tuple[Extent, ...]:
        return self.gate_up + self.down

    @property
    def nbytes(self) -> int:
        return sum(x.length for x in self.extents)

    @property
    def numel(self) -> int:
        return sum(math.prod(x.shape) for x in self.extents)


ExtentMap = dict[tuple[int, int], ExpertExtents]  # (layer, expert) → its extents


def weight_files(folder: Path) -> dict[str, str]:
    """tensor name → file (relative to folder), as open_checkpoint finds them: the index, else
    model.safetensors, else the one *.safetensors file that is not a packed expert file."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {str(name): str(file) for name, file in weight_map.items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise CheckpointError(f"{index}: not a valid safetensors index") from None
    single = folder / SINGLE_NAME
    if not single.is_file():
        others = sorted(p.name for p in folder.glob("*.safetensors") if p.name != PACKED_NAME)
        if len(others) != 1:
            found = f"{len(others)} safetensors files and no {INDEX_NAME}" if others else "no *.safetensors weights"
            raise CheckpointError(f"{folder}: {found}")
        single = folder / others[0]
    return {name: single.name for name in read_header(single).tensors}


class _Files:
    """Headers read once per file, and each tensor's checked entry."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.where = weight_files(folder)
        self.headers: dict[str, Header] = {}

    def entry(self, name: str, shape: tuple[int, ...]) -> tuple[str, int, str]:
        """(file, absolute offset, dtype) of tensor `name`, which must have `shape`."""
        if name not in self.where:
            if f"{name}_blocks" in self.where:  # gpt-oss as published (moekit.weights.quantized)
                raise CheckpointError(f"{self.folder}: MXFP4 experts ({name}_blocks) are not paged by the expert store yet")
            raise CheckpointError(f"{self.folder}: tensor {name} is missing (a routed expert's weight)")
        file = self.where[name]
        if file not in self.headers:
            path = self.folder / file
            if not path.is_file():
                raise CheckpointError(f"{self.folder}: missing shard {file} (listed in {INDEX_NAME})")
            self.headers[file] = read_header(path)
        header = self.headers[file]
        if name not in header.tensors:
            raise CheckpointError(f"{self.folder / file}: tensor {name} listed in the index but not in the file")
        meta = header.tensors[name]
        if tuple(meta["shape"]) != shape:
            raise CheckpointError(f"{self.folder}: tensor {name} has shape {meta['shape']}, expected {list(shape)}")
        dtype = meta["dtype"]
        if dtype not in FLOATS:
            raise CheckpointError(
                f"{self.folder}: tensor {name} is stored as {dtype}; the expert store reads "
                f"{', '.join(FLOATS)} weights only"
            )
        begin, end = meta["data_offsets"]
        if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
            raise CheckpointError(f"{self.folder / file}: corrupted safetensors header (size of {name})")
        if header.data_start + end > header.file_size:
            raise CheckpointError(f"{self.folder / file}: truncated safetensors file (tensor {name} runs past its end)")
        return file, header.data_start + begin, dtype

    def whole(self, name: str, shape: tuple[int, ...]) -> Extent:
        file, offset, dtype = self.entry(name, shape)
        return Extent(file, offset, math.prod(shape) * ITEMSIZE[dtype], dtype, shape)

    def row(self, name: str, shape: tuple[int, ...], e: int) -> Extent:
        """Slice e of a stacked [E, ...] tensor: contiguous, so one extent."""
        file, offset, dtype = self.entry(name, shape)
        length = math.prod(shape[1:]) * ITEMSIZE[dtype]
        return Extent(file, offset + e * length, length, dtype, tuple(shape[1:]))


def expert_extents(folder: str | Path, spec: ModelSpec) -> ExtentMap:
    """Every routed expert of every MoE layer, (layer, expert) → where its gate_up and down are."""
    folder = Path(folder)
    names = hub_names(spec.model_type)
    files = _Files(folder)
    out: ExtentMap = {}
    for layer in spec.moe_layers:
        moe = spec.layers[layer].ffn
        assert isinstance(moe, MoESpec)
        d, f, n = moe.expert.hidden_size, moe.expert.width, moe.num_experts
        rows = (2 if moe.expert.gated else 1) * f
        block = f"{names.prefix}.{names.layers}.{layer}.{names.moe}"
        if names.experts == "stacked_rows":
            raise CheckpointError(f"{spec.model_type}: the stacked expert rows of this family cannot be paged by the expert store yet")
        for e in range(n):
            if names.experts == "stacked":
                gate_up = (files.row(f"{block}.{names.stacked_gate_up}", (n, rows, d), e),)
                down = (files.row(f"{block}.{names.stacked_down}", (n, d, f), e),)
                out[layer, e] = ExpertExtents(gate_up, down)
            elif names.experts in ("stacked_interleaved", "stacked_transposed"):
                gate_up = (files.row(f"{block}.{names.stacked_gate_up}", (n, d, rows), e),)
                down = (files.row(f"{block}.{names.stacked_down}", (n, f, d), e),)
                layout = "interleaved_transposed" if names.experts == "stacked_interleaved" else "transposed"
                out[layer, e] = ExpertExtents(gate_up, down, layout)
            else:
                kinds = [names.expert_gate, names.expert_up] if moe.expert.gated else [names.expert_up]
                prefix = f"{block}.experts.{e}"
                gate_up = tuple(files.whole(f"{prefix}.{k}.weight", (f, d)) for k in kinds)
                down = (files.whole(f"{prefix}.{names.expert_down}.weight", (d, f)),)
                out[layer, e] = ExpertExtents(gate_up, down)
    return out


def our_shapes(experts: ExpertExtents) -> tuple[tuple[int, int], tuple[int, int]]:
    """(gate_up [rows, D], down [D, F]) of one expert in our layout."""
    if experts.layout in ("interleaved_transposed", "transposed"):
        (gu,), (dn,) = experts.gate_up, experts.down
        return (gu.shape[1], gu.shape[0]), (dn.shape[1], dn.shape[0])
    rows = sum(x.shape[0] for x in experts.gate_up)
    (down,) = experts.down
    return (rows, experts.gate_up[0].shape[1]), (down.shape[0], down.shape[1])


def referenced_files(extents: ExtentMap) -> list[str]:
    return sorted({x.file for ex in extents.values() for x in ex.extents})
