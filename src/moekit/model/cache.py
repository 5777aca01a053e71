"""The decode cache: one preallocated entry per layer plus which slots hold real (non-pad) tokens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class KVCache:
    layers: list  # one entry per layer: whatever that layer's mixer.new_cache() returned
    key_mask: Tensor  # [B, S_max] bool, True where a real token sits; prompts are LEFT-padded
    length: int = 0  # slots already written (the same for every row)
    # [N, ...]: every layer's cache tensors (slot_tensors order) as one tensor, the entries views of
    # it, when all N share a shape (stacked_layers); the compiled step reads and writes this one.
    stack: Optional[Tensor] = None

    @property
    def batch(self) -> int:
        return self.key_mask.shape[0]

    @property
    def max_len(self) -> int:
        return self.key_mask.shape[1]


def slot_tensors(entry) -> list[tuple[Tensor, int]]:
    """A layer's cache tensors with the axis their slots lie on: attention keeps (k, v), each
    [B, Hkv, S, hd]; MLA one [B, S, R+Rr] (moekit.model.mla.MLACache)."""
    if isinstance(entry, tuple):
        return [(t, 2) for t in entry]
    return [(entry.slots, 1)]


def stacked_layers(layers: list, device, stacked: bool = True) -> tuple[list, Optional[Tensor]]:
    """(entries, stack): `layers` (the mixers' caches, made on the meta device for their shapes) made
    real as views of one zeroed [N, ...] tensor when all N cache tensors share a shape and dtype (and
    `stacked`), else each allocated on its own and stack None. Why one tensor: the compiled step
    takes each input's length as a dynamic size of its own, and ~20 of them cost ~0.1 ms a step."""
    tensors = [t for entry in layers for t, _ in slot_tensors(entry)]
    if stacked and tensors and len({(t.shape, t.dtype) for t in tensors}) == 1:
        stack = torch.zeros((len(tensors), *tensors[0].shape), dtype=tensors[0].dtype, device=device)
        # One select view each (not unbind's multi-output views, which autograd forbids writing into
        # in place under grad mode).
        views = iter([stack[i] for i in range(len(tensors))])
    else:
        stack = None
        views = (torch.zeros(t.shape, dtype=t.dtype, device=device) for t in tensors)
    return [_with_tensors(entry, views) for entry in layers], stack


def _with_tensors(entry, views):
    """The same cache entry holding the next tensors of `views` in place of its own."""
    if isinstance(entry, tuple):
        return tuple(next(views) for _ in entry)
    return dataclasses.replace(entry, slots=next(views))


def copy_row(dst: KVCache, dst_row: int, src: KVCache, src_row: int, length: int, src_start: int = 0) -> None:
    """Slots src_start.. src_start+length-1 of src's row into slots 0..length-1 of dst's row, every
    layer: a prefilled request joins the running batch (from a left-padded prefill, its real
    tokens start at src_start), or a row moves down to keep the running rows contiguous."""
    axes = {axis for entry in dst.layers for _, axis in slot_tensors(entry)}
    if dst.stack is not None and src.stack is not None and len(axes) == 1:
        # One copy for every layer, not one per tensor (32 on a 16-layer model: ~0.1 ms of a request's
        # time to first token). A stack's [N, B, ...]: row r's [N, ...] has its slots where a layer's
        # [B, ...] has them.
        axis = axes.pop()
        dst.stack[:, dst_row].narrow(axis, 0, length).copy_(src.stack[:, src_row].narrow(axis, src_start, length))
        return
    for dst_entry, src_entry in zip(dst.layers, src.layers):
        for (d, axis), (s, _) in zip(slot_tensors(dst_entry), slot_tensors(src_entry)):
            d[dst_row].narrow(axis - 1, 0, length).copy_(s[src_row].narrow(axis - 1, src_start, length))
