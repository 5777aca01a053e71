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

import torch
from torch import Tensor

from moekit.errors import CheckpointError
from moekit.weights.gguf_file import GGUFTensor

ROW_BLOCK = 17  # bytes per 32 inputs: the scale, then 16 bytes of codes (either layout)


def hub_nibbles_(rows: Tensor) -> Tensor:
    """rows uint8 [R, G · 17] with ggml's code bytes → the same rows with the Hub's, in place."""
    codes = rows.view(rows.shape[0], -1, ROW_BLOCK)[..., 1:]  # [R, G, 16]
    even, odd = codes[..., 0::2], codes[..., 1::2]  # [R, G, 8]: ggml bytes 2i and 2i+1
    low = (even & 0x0F) | ((odd & 0x0F) << 4)  # Hub bytes 0-7: values 2i, 2i+1 (ggml's low nibbles)
    high = (even >> 4) | (odd & 0xF0)  # Hub bytes 8-15: values 16+2i, 17+2i (ggml's high nibbles)
    codes[..., :8] = low
    codes[..., 8:] = high
    return rows


def read_into(fd: int, offset: int, out: Tensor, where: Path) -> None:
    """Fill the contiguous uint8 tensor `out` with the file's bytes from `offset`."""
    view = memoryview(out.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{where}: truncated GGUF (no bytes at {offset + done})")
        done += n


def _slice(t: GGUFTensor, j: int) -> tuple[int, int, int]:
    """(offset, rows, bytes per row) of expert j in a stacked ggml MXFP4 tensor [E, R, G · 17]."""
    experts, rows, row_bytes = t.data.shape
    return t.offset + j * rows * row_bytes, rows, row_bytes


def expert_rows(path: Path, gate: GGUFTensor, up: GGUFTensor, down: GGUFTensor, j: int) -> tuple[Tensor, Tensor]:
    """Expert j's prepared (gate_up uint8 [2F, G · 17]: gate's rows, then up's; down [D, G' · 17])."""
    (g_at, f, g_bytes), (u_at, _, _), (d_at, d, d_bytes) = (_slice(t, j) for t in (gate, up, down))
    gate_up = torch.empty((2 * f, g_bytes), dtype=torch.uint8)
    dn = torch.empty((d, d_bytes), dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_into(fd, g_at, gate_up[:f], path)
        read_into(fd, u_at, gate_up[f:], path)
        read_into(fd, d_at, dn, path)
    finally:
        os.close(fd)
    return hub_nibbles_(gate_up), hub_nibbles_(dn)
