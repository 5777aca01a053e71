"""The precision each routed expert is packed at, and what one expert then costs in bytes.

`moekit pack --precision P` writes every routed expert at P; `--precision-by-profile profile.json
--hot P --cold Q --hot-share S` writes each layer's most used experts (a `moekit profile` of this
model) at P and the others at Q. The precisions:

  bf16, fp32   the float the store casts to the engine's dtype on load (as a checkpoint's experts)
  int8         q8_0: per 32 inputs a float16 scale + 32 int8 (34 bytes, 8.5 bits a weight),
               moekit.model.int8; multiplied by the int8 kernels straight from the bytes read
  int4         q4_0: per 32 inputs a float16 scale + 16 bytes of nibbles (18 bytes, 4.5 bits),
               moekit.model.int4; multiplied by its reference kernel

In a packed file and its manifest a quantized weight is an extent of dtype "Q8_0" or "Q4_0" (GGUF's
names) whose shape is its bytes, [out, nb * block bytes], nb = ceil(in / 32): the kernel's layout.
Experts a checkpoint publishes packed (layouts "mxfp4", "fp8": moekit.weights.extents) are their
own kinds, "MXFP4" and "FP8", held as moekit.ops.packed_layout's prepared rows; a gpt-oss GGUF's
ggml MXFP4 experts (layout "gguf_mxfp4") are "MXFP4" too: the same prepared rows, the same kernels.
No torch here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Optional

from moekit.calc.dtypes import canonical_dtype
from moekit.errors import MoekitError
from moekit.weights.extents import ExpertExtents, our_shapes, pairs
from moekit.spec.model_spec import ModelSpec

BLOCK = 32  # inputs per scale, both formats
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}  # stored dtype → bytes per block
STORED = {"bf16": "BF16", "fp32": "F32", "int8": "Q8_0", "int4": "Q4_0"}  # precision → extent dtype
PRECISIONS = tuple(STORED)
FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}

Precisions = dict[tuple[int, int], str]  # (layer, expert) → one of PRECISIONS


def is_quantized(dtype: str) -> bool:
    """Whether an extent's dtype is a block format (its bytes are the kernel's layout)."""
    return dtype in BLOCK_BYTES


def parse_precision(text: str, option: str) -> str:
    name = canonical_dtype(text)  # the one vocabulary: bfloat16 is bf16 here as in run and calc
    if name not in STORED:
        raise MoekitError(f"{option} {text!r}: expected one of {', '.join(PRECISIONS)}")
    return name


def quantized_shape(dtype: str, shape: tuple[int, int]) -> tuple[int, int]:
    """A weight [out, in] as the bytes of its blocks, [out, nb * block bytes]."""
    out, inp = shape
    return out, math.ceil(inp / BLOCK) * BLOCK_BYTES[dtype]


def weight_bytes(dtype: str, shape: tuple[int, int]) -> int:
    """Bytes of a weight [out, in] (our layout) stored as `dtype` (a float or a block format)."""
    if is_quantized(dtype):
        return math.prod(quantized_shape(dtype, shape))
    return math.prod(shape) * FLOAT_BYTES[dtype]


# layout → kind of experts paged as published (a GGUF's MXFP4 is the Hub's, its nibbles reordered)
PUBLISHED_KINDS = {"mxfp4": "MXFP4", "fp8": "FP8", "gguf_mxfp4": "MXFP4"}


def stored_kind(ex: ExpertExtents) -> Optional[str]:
    """"Q8_0" / "Q4_0" when the expert is stored in that block format, "MXFP4" / "FP8" when it is
    paged as its checkpoint publishes it, None for a float one."""
    if ex.layout in PUBLISHED_KINDS:
        return PUBLISHED_KINDS[ex.layout]
    kinds = {x.dtype for x in ex.extents if is_quantized(x.dtype)}
    if not kinds:
        return None
    if len(kinds) > 1 or len(kinds) != len({x.dtype for x in ex.extents}):
        raise MoekitError(f"an expert mixes {sorted({x.dtype for x in ex.extents})} in one manifest entry")
    return kinds.pop()


def memory_bytes(ex: ExpertExtents, float_dtype: str, quantize: bool = False) -> int:
    """Bytes one expert holds once loaded: a block format as stored; a float one at the engine's
    `float_dtype` ("F32", "BF16"), or as q8_0 when the store quantizes floats on load (`quantize`)."""
    kind = stored_kind(ex)
    if kind == "FP8":
        return fp8_rows_bytes(ex)
    if kind is not None:
        return ex.nbytes  # block formats and MXFP4's prepared rows [out, G·17] are the stored bytes
    up, down = our_shapes(ex)
    held = "Q8_0" if quantize else float_dtype
    return weight_bytes(held, up) + weight_bytes(held, down)


def fp8_rows_bytes(ex: ExpertExtents) -> int:
    """An FP8 expert as prepared rows (moekit.ops.packed_layout): each weight [out, in + 4·nbc], one fp32
    scale per column block and row, so that rows stay independent (the file has one per block)."""
    return sum(w.shape[0] * (w.shape[1] + 4 * scales.shape[1]) for w, scales in pairs(ex.gate_up) + pairs(ex.down))


def parse_share(text: str, option: str = "--hot-share") -> float:
    """'25%' or '0.25' → 0.25, within [0, 1]."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise MoekitError(f"{option} {text!r}: expected a share such as 25% or 0.25") from None
    if not 0 <= value <= 1 or math.isnan(value):
        raise MoekitError(f"{option} {text!r}: must be between 0% and 100%")
    return value


def uniform(spec: ModelSpec, precision: str) -> Precisions:
    return {(l, e): precision for l in spec.moe_layers for e in range(spec.layers[l].ffn.num_experts)}  # type: ignore[union-attr]


def read_counts(path: Path, folder: Path, spec: ModelSpec) -> dict[int, list[int]]:
    """Per MoE layer, each expert's use count from a `moekit profile` of this model. The model
    check is the one `--pin` makes (moekit.offload.pins.read_pins): a profile of another model
    would keep the wrong experts precise."""
    from moekit.offload.pins import read_pins

    read_pins(path, folder, spec)  # format and model identity, one clear line when wrong
    try:
        raw = json.loads(Path(path).read_text())["counts"]
        counts = {int(l): [int(c) for c in row] for l, row in raw.items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise MoekitError(f"{path}: a profile without per-layer expert counts; write it with `moekit profile`") from None
    for l in spec.moe_layers:
        width = spec.layers[l].ffn.num_experts  # type: ignore[union-attr]
        row = counts.get(l)
        if row is None or len(row) != width or any(c < 0 for c in row):
            raise MoekitError(f"{path}: layer {l} needs {width} non-negative expert counts")
    return {l: counts[l] for l in spec.moe_layers}


def by_frequency(counts: Mapping[int, list[int]], hot: str, cold: str, share: float) -> Precisions:
    """Per layer, the round(share × E) most used experts (ties: lower id, as pins) at `hot`, the
    rest at `cold`. An expert the profile never saw is cold whatever the share."""
    from moekit.offload.pins import ranked_pins

    out: Precisions = {}
    for l, row in counts.items():
        n = round(share * len(row))
        chosen = set(ranked_pins({l: row}, n)[l]) if n else set()
        for e in range(len(row)):
            out[l, e] = hot if e in chosen else cold
    return out


def describe(precisions: Mapping[tuple[int, int], str]) -> str:
    """'32 bf16 + 96 int4' (in PRECISIONS order, then others such as mxfp4 as met)."""
    tally = {p: 0 for p in PRECISIONS}
    for p in precisions.values():
        tally[p] = tally.get(p, 0) + 1
    return " + ".join(f"{n} {p}" for p, n in tally.items() if n)
