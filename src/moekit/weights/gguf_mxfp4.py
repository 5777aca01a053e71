"""gpt-oss's MXFP4 experts read from a GGUF straight into the kernels' prepared rows.

A ggml MXFP4 block and a block of a prepared row (moekit.ops.packed_layout) are both 17 bytes per
32 inputs: the E8M0 scale byte, then 16 bytes of FP4 codes. Only where each value's nibble sits
differs: ggml puts values 0-15 in the low nibbles of bytes 0-15 and values 16-31 in the high
ones; the Hub's layout, which the kernels take, puts value 2i in the low nibble of byte i and 2i+1
in its high nibble. So an expert's prepared rows are its bytes read from the file into the tensor
the engine keeps, then its code bytes reordered in place, a few MB at a time: no whole-tensor
copy and no Hub layout in between. The bytes are read with pread, not through the memory map,
whose pages would count in the process's RSS on top of the weights they were copied into.

gpt-oss's converter splits the Hub's interleaved gate_up rows into ffn_gate_exps (the even rows)
and ffn_up_exps (the odd rows); the kernels want gate's rows then up's: the two slices, one after
the other.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moekit.errors import CheckpointError
from moekit.weights.gguf_file import GGUFTensor

ROW_BLOCK = 17  # bytes per 32 inputs: the scale, then 16 bytes of codes (either layout)
_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_4, _32 = np.uint64(4), np.uint64(32)  # numpy shifts a uint64 only by a uint64
# uint64s in each of hub_nibbles_'s temporaries: 64 KiB, which stay in cache, and below the 128 KiB
# from which glibc maps (and page-faults) every allocation afresh once the store pins its threshold.
CHUNK_WORDS = 8 * 1024


def hub_nibbles_(rows: Tensor) -> Tensor:
    """rows uint8 [R, G · 17] with ggml's code bytes → the same rows with the Hub's, in place.

    Each block's 16 code bytes are two little-endian words (unaligned: after the scale byte); a
    word's low nibbles are 8 consecutive values, 4 Hub bytes once packed two to a byte, and its high
    nibbles 8 more. Whole-word arithmetic is several times faster than byte-wise gathers here (and
    than a 64K-entry table of byte pairs, measured). A few rows at a time: the dozen temporaries
    then stay in cache and on the heap instead of each being a fresh mapping of MBs, faulted in page
    by page (the paged store pays this on every miss: docs/BENCHMARKS.md, "Paged gpt-oss-20b GGUF")."""
    r, width = rows.shape
    step = max(1, CHUNK_WORDS // (width // ROW_BLOCK))  # rows at a time
    for start in range(0, r, step):
        _hub_nibbles_rows_(rows[start : start + step])
    return rows


def _hub_nibbles_rows_(rows: Tensor) -> None:
    r, width = rows.shape
    words = np.ndarray((r, width // ROW_BLOCK, 2), dtype="<u8", buffer=rows.numpy(), offset=1,
                       strides=(width, ROW_BLOCK, 8))  # [R, G, 2]: ggml code bytes 0-7, 8-15
    first, second = words[..., 0].copy(), words[..., 1].copy()  # [R, G]
    low = _pack(first & _NIBBLES) | (_pack(second & _NIBBLES) << _32)  # values 0-15: Hub bytes 0-7
    high = _pack((first >> _4) & _NIBBLES) | (_pack((second >> _4) & _NIBBLES) << _32)  # values 16-31
    words[..., 0], words[..., 1] = low, high


def _pack(m):
    """uint64 words holding one nibble in each byte's low half → those 8 nibbles packed into the
    low 4 bytes, first nibble lowest (byte i of the result: nibble 2i low, nibble 2i+1 high)."""
    m = (m | (m >> _4)) & np.uint64(0x00FF00FF00FF00FF)  # nibble pairs in each 16-bit lane's low byte
    m = (m | (m >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return (m | (m >> np.uint64(16))) & np.uint64(0xFFFFFFFF)


def read_into(fd: int, offset: int, out: Tensor, where: Path) -> None:
    """Fill the contiguous uint8 tensor `out` with the file's bytes from `offset`."""
    view = memoryview(out.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{where}: truncated GGUF (no bytes at {offset + done})")
        done += n


def _slice(t: GGUFTensor, j: int) -> int:
    """Where expert j's bytes start in a stacked ggml MXFP4 tensor [E, R, G · 17]."""
    experts, rows, row_bytes = t.data.shape
    return t.offset + j * rows * row_bytes


def layer_rows(path: Path, gate: GGUFTensor, up: GGUFTensor, down: GGUFTensor) -> tuple[Tensor, Tensor]:
    """A layer's experts as prepared rows (gate_up uint8 [E, 2F, G · 17]: each expert's gate rows,
    then its up rows; down [E, D, G' · 17]), read and reordered one expert at a time.

    One tensor per layer, not one per expert: allocations this large are memory maps of their own,
    which free() gives back to the system when the loader moves the weights on (into huge pages),
    while a few MB each would come from the heap, which keeps the freed space: a second copy of
    the experts in RSS."""
    experts, f, g_bytes = gate.data.shape
    _, d, d_bytes = down.data.shape
    gate_up = torch.empty((experts, 2 * f, g_bytes), dtype=torch.uint8)
    dn = torch.empty((experts, d, d_bytes), dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        for j in range(experts):
            read_into(fd, _slice(gate, j), gate_up[j, :f], path)
            read_into(fd, _slice(up, j), gate_up[j, f:], path)
            read_into(fd, _slice(down, j), dn[j], path)
            hub_nibbles_(gate_up[j])
            hub_nibbles_(dn[j])
    finally:
        os.close(fd)
    return gate_up, dn
