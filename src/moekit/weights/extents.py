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
  "rows_transposed_down"    dbrx: gate_up is rows e·F..(e+1)·F of w1 then of v1 [E·F, D] (rows, as
                            ours); down is those rows of w2 [E·F, D], applied x @ W: transposed
  "mxfp4"                   gpt_oss as published: each part is (blocks, scales), slice e of
                            `*_blocks` [E, R, G, 16] and `*_scales` [E, R, G] (U8); gate_up's R rows
                            are gate, up, gate, up, ... (the bf16 tensor's interleaved columns)
  "fp8"                     per-expert block-scaled FP8 (DeepSeek-V3): each weight is (its
                            F8_E4M3 [out, in], its weight_scale_inv [nbr, nbc]); gate_up is gate's
                            pair then up's
  "gguf_mxfp4"              gpt_oss as llama.cpp converts it: gate_up is (slice e of ffn_gate_exps,
                            of ffn_up_exps), down slice e of ffn_down_exps, each ggml MXFP4 bytes
                            [R, G·17] (moekit.weights.gguf_mxfp4): the gate rows, then the up rows

The last three stay packed in memory too: the reader turns them into moekit.ops.packed_layout's prepared
rows (mxfp4 [out, G·17], fp8 [out, in + 4·nbc]), the bytes the packed kernels read, so a slot
holds 4.25 / 8.25 bits a weight and a miss moves the published bytes, nothing more.

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
from moekit.weights.hub_names import HubNames, hub_names
from moekit.spec.model_spec import ModelSpec, MoESpec

Layout = Literal["rows", "interleaved_transposed", "transposed", "rows_transposed_down", "mxfp4", "fp8", "gguf_mxfp4"]
LAYOUTS: tuple[str, ...] = ("rows", "interleaved_transposed", "transposed", "rows_transposed_down", "mxfp4", "fp8",
                            "gguf_mxfp4")
PUBLISHED = ("mxfp4", "fp8")  # layouts of experts kept as the checkpoint publishes them

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PACKED_NAME = "experts.packed.safetensors"

# Bytes per element of the safetensors dtypes an expert may be stored in (a float the engine can
# cast from exactly as loading.py's copy_ does).
FLOATS: dict[str, int] = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
# ... and in a packed file, the block formats of moekit.offload.precision: their extents' shapes
# count bytes ([out, nb * block bytes]), so one "element" is a byte.
ITEMSIZE: dict[str, int] = {**FLOATS, "Q8_0": 1, "Q4_0": 1}
# ... and the published formats' pieces: MXFP4 blocks and scales (bytes), FP8 codes.
ITEMSIZE.update({"U8": 1, "F8_E4M3": 1})
# ... and a GGUF's K-quants, which the store dequantizes as it reads them (to the engine dtype, as
# the resident load does): (weights, bytes) per ggml super-block; their shapes count bytes too.
DEQUANTIZED: dict[str, tuple[int, int]] = {"Q4_K": (256, 144), "Q6_K": (256, 210)}
ITEMSIZE.update({k: 1 for k in DEQUANTIZED})
# ... and a GGUF's MXFP4 (gpt_oss): bytes [R, G · 17] per expert slice, a shape that counts bytes.
ITEMSIZE["MXFP4"] = 1
MXFP4_BLOCK = 32  # inputs per E8M0 scale (moekit.weights.mxfp4, which needs torch)
MXFP4_BLOCK_BYTES = 17  # a ggml MXFP4 block, as a prepared row's: the E8M0 scale, then 16 bytes of codes



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

    def meta(self, name: str) -> tuple[str, Header, dict]:
        """(file, its header, the tensor's header entry) of tensor `name`."""
        if name not in self.where:
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
        return file, header, header.tensors[name]

    def dtype(self, name: str) -> str:
        return self.meta(name)[2]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta(name)[2]["shape"])

    def entry(self, name: str, shape: tuple[int, ...], dtypes=FLOATS) -> tuple[str, int, str]:
        """(file, absolute offset, dtype) of tensor `name`, which must have `shape` and one of `dtypes`."""
        file, header, meta = self.meta(name)
        if tuple(meta["shape"]) != shape:
            raise CheckpointError(f"{self.folder}: tensor {name} has shape {meta['shape']}, expected {list(shape)}")
        dtype = meta["dtype"]
        if dtype not in dtypes:
            raise CheckpointError(
                f"{self.folder}: tensor {name} is stored as {dtype}; the expert store reads "
                f"{', '.join(dtypes)} weights only"
            )
        begin, end = meta["data_offsets"]
        if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
            raise CheckpointError(f"{self.folder / file}: corrupted safetensors header (size of {name})")
        if header.data_start + end > header.file_size:
            raise CheckpointError(f"{self.folder / file}: truncated safetensors file (tensor {name} runs past its end)")
        return file, header.data_start + begin, dtype

    def whole(self, name: str, shape: tuple[int, ...], dtypes=FLOATS) -> Extent:
        file, offset, dtype = self.entry(name, shape, dtypes)
        return Extent(file, offset, math.prod(shape) * ITEMSIZE[dtype], dtype, shape)

    def row(self, name: str, shape: tuple[int, ...], e: int, dtypes=FLOATS) -> Extent:
        """Slice e of a stacked [E, ...] tensor: contiguous, so one extent."""
        file, offset, dtype = self.entry(name, shape, dtypes)
        length = math.prod(shape[1:]) * ITEMSIZE[dtype]
        return Extent(file, offset + e * length, length, dtype, tuple(shape[1:]))

    def rows(self, name: str, shape: tuple[int, int], begin: int, n: int) -> Extent:
        """Rows begin..begin+n of a 2-D tensor [R, C] (dbrx's [E·F, D]): contiguous, so one extent."""
        file, offset, dtype = self.entry(name, shape)
        row = shape[1] * ITEMSIZE[dtype]
        return Extent(file, offset + begin * row, n * row, dtype, (n, shape[1]))


def _published(folder: Path, method: str, name: str, dtype: str) -> CheckpointError:
    """`moekit pack` rewrites experts in our layout at a float or block precision; experts published
    packed are paged as they are instead, so there is nothing for it to write."""
    return CheckpointError(
        f"{folder}: {method} experts (stored as {dtype}, e.g. {name}) are paged as published; "
        "moekit pack does not rewrite them (run the checkpoint with --expert-memory directly)"
    )


def _mxfp4_expert(files: _Files, block: str, names: HubNames, e: int, n: int, rows: int, d: int, f: int) -> ExpertExtents:
    """gpt_oss's expert e as published: (blocks, scales) of gate_up [rows, D/32, 16] and of down [D, F/32, 16]."""
    def pair(name: str, out: int, inp: int) -> tuple[Extent, Extent]:
        groups = inp // MXFP4_BLOCK
        blocks = files.row(f"{name}_blocks", (n, out, groups, MXFP4_BLOCK // 2), e, ("U8",))
        return blocks, files.row(f"{name}_scales", (n, out, groups), e, ("U8",))

    gate_up = pair(f"{block}.{names.stacked_gate_up}", rows, d)
    down = pair(f"{block}.{names.stacked_down}", d, f)
    return ExpertExtents(gate_up, down, "mxfp4")


def _fp8_expert(files: _Files, prefix: str, kinds: list[str], down: str, d: int, f: int) -> ExpertExtents:
    """A per-expert FP8 expert: each weight's F8_E4M3 codes [out, in] and its weight_scale_inv
    [nbr, nbc] (a float; the block it implies is config.json's, checked when the checkpoint opens)."""
    def pair(kind: str, shape: tuple[int, int]) -> tuple[Extent, Extent]:
        weight = files.whole(f"{prefix}.{kind}.weight", shape, ("F8_E4M3",))
        scale = f"{prefix}.{kind}.weight_scale_inv"
        grid = files.shape(scale)
        if len(grid) != 2:
            raise CheckpointError(f"{files.folder}: FP8 scales {scale} have shape {list(grid)}, expected [out blocks, in blocks]")
        return weight, files.whole(scale, grid)

    gate_up = tuple(x for kind in kinds for x in pair(kind, (f, d)))
    return ExpertExtents(gate_up, pair(down, (d, f)), "fp8")


def expert_extents(folder: str | Path, spec: ModelSpec, published: bool = False) -> ExtentMap:
    """Every routed expert of every MoE layer, (layer, expert) → where its gate_up and down are.
    published: the caller pages MXFP4 / FP8 experts as published (the store, the manifest);
    False refuses them in one line (`moekit pack`, which rewrites experts in our layout)."""
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
        kinds = [names.expert_gate, names.expert_up] if moe.expert.gated else [names.expert_up]
        mxfp4 = f"{block}.{names.stacked_gate_up}_blocks" in files.where
        if mxfp4 and names.experts != "stacked_interleaved":
            raise CheckpointError(f"{folder}: MXFP4 experts of {spec.model_type} ({names.stacked_gate_up}_blocks) "
                                  "are not paged by the expert store (only gpt_oss's layout is)")
        if mxfp4 and not published:
            raise _published(folder, "MXFP4", f"{block}.{names.stacked_gate_up}_blocks", "U8")
        first = f"{block}.experts.0.{kinds[0]}.weight"
        fp8 = names.experts == "per_expert" and first in files.where and files.dtype(first) == "F8_E4M3"
        if fp8 and not published:
            raise _published(folder, "FP8", first, "F8_E4M3")
        for e in range(n):
            if mxfp4:
                out[layer, e] = _mxfp4_expert(files, block, names, e, n, rows, d, f)
            elif fp8:
                out[layer, e] = _fp8_expert(files, f"{block}.experts.{e}", kinds, names.expert_down, d, f)
            elif names.experts == "stacked":
                gate_up = (files.row(f"{block}.{names.stacked_gate_up}", (n, rows, d), e),)
                down = (files.row(f"{block}.{names.stacked_down}", (n, d, f), e),)
                out[layer, e] = ExpertExtents(gate_up, down)
            elif names.experts == "stacked_rows":
                # dbrx: expert e is rows e·F..(e+1)·F of each [E·F, D] tensor.
                gate_up = tuple(files.rows(f"{block}.{k}", (n * f, d), e * f, f) for k in kinds)
                down = (files.rows(f"{block}.{names.expert_down}", (n * f, d), e * f, f),)
                out[layer, e] = ExpertExtents(gate_up, down, "rows_transposed_down")
            elif names.experts in ("stacked_interleaved", "stacked_transposed"):
                gate_up = (files.row(f"{block}.{names.stacked_gate_up}", (n, d, rows), e),)
                down = (files.row(f"{block}.{names.stacked_down}", (n, f, d), e),)
                layout = "interleaved_transposed" if names.experts == "stacked_interleaved" else "transposed"
                out[layer, e] = ExpertExtents(gate_up, down, layout)
            else:
                prefix = f"{block}.experts.{e}"
                gate_up = tuple(files.whole(f"{prefix}.{k}.weight", (f, d)) for k in kinds)
                down = (files.whole(f"{prefix}.{names.expert_down}.weight", (d, f)),)
                out[layer, e] = ExpertExtents(gate_up, down)
    return out


def pairs(part: tuple[Extent, ...]) -> list[tuple[Extent, Extent]]:
    """A published layout's part as (data, scales) pairs: one per weight (FP8's gate_up has two)."""
    return list(zip(part[0::2], part[1::2]))


def extent_counts_fit(layout: str, gate_up: int, down: int) -> bool:
    """Whether a manifest entry with these numbers of gate_up and down extents can be of `layout`."""
    if layout in PUBLISHED:
        return down == 2 and (gate_up == 2 or (layout == "fp8" and gate_up == 4))
    if layout == "gguf_mxfp4":
        return gate_up == 2 and down == 1
    if layout in ("interleaved_transposed", "transposed"):
        return gate_up == 1 and down == 1
    return gate_up >= 1 and down == 1


def our_shapes(experts: ExpertExtents) -> tuple[tuple[int, int], tuple[int, int]]:
    """(gate_up [rows, D], down [D, F]) of one expert in our layout (a published one's dequantized)."""
    if experts.layout in ("interleaved_transposed", "transposed"):
        (gu,), (dn,) = experts.gate_up, experts.down
        return (gu.shape[1], gu.shape[0]), (dn.shape[1], dn.shape[0])
    if experts.layout == "mxfp4":
        (up, _), (down, _) = pairs(experts.gate_up) + pairs(experts.down)
        return (up.shape[0], up.shape[1] * MXFP4_BLOCK), (down.shape[0], down.shape[1] * MXFP4_BLOCK)
    if experts.layout == "gguf_mxfp4":
        inputs = [x.shape[1] // MXFP4_BLOCK_BYTES * MXFP4_BLOCK for x in experts.extents]
        (gate, up), (down,) = experts.gate_up, experts.down
        return (gate.shape[0] + up.shape[0], inputs[0]), (down.shape[0], inputs[2])
    if experts.layout == "fp8":
        weights = [w for w, _ in pairs(experts.gate_up)]
        (down, _), = pairs(experts.down)
        return (sum(w.shape[0] for w in weights), weights[0].shape[1]), (down.shape[0], down.shape[1])
    if experts.layout == "rows_transposed_down":
        (down,) = experts.down
        return (sum(x.shape[0] for x in experts.gate_up), experts.gate_up[0].shape[1]), (down.shape[1], down.shape[0])
    rows = sum(x.shape[0] for x in experts.gate_up)
    (down,) = experts.down
    return (rows, row_width(experts.gate_up[0])), (down.shape[0], row_width(down))


def row_width(x: Extent) -> int:
    """Inputs per row of a "rows" extent: its last size, or for a K-quant (bytes) the weights they hold."""
    if x.dtype in DEQUANTIZED:
        weights, nbytes = DEQUANTIZED[x.dtype]
        return x.shape[1] // nbytes * weights
    return x.shape[1]


def referenced_files(extents: ExtentMap) -> list[str]:
    return sorted({x.file for ex in extents.values() for x in ex.extents})
