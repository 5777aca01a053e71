"""A plain PyTorch reference for every C++ operator: the same arguments, the same result up to the
order of fp32 sums (bit for bit where the operator's order is torch's: argmax, the transposing copy).

These are what the tests hold each build of the operators to, and what runs where the operators are
not built or `--kernels reference` was asked for. Legend: B rows, C choices, E experts, N outputs,
K inputs, H heads, S cached positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moekit.ops import packed_layout
from moekit.ops.q8_0 import dequantize_q8_0, round_to_q16
from moekit.ops.tiles import from_tiles


def _chosen_rows(x: Tensor, ids: Tensor) -> Tensor:
    """x [B, X, K] → [B, C, K]: row b's x for each of its C choices (x[b, 0] when X = 1, else x[b, c])."""
    return x.expand(-1, ids.shape[1], -1) if x.shape[1] == 1 else x


def rows_gemv(x: Tensor, w: Tensor, grouped: bool = False) -> Tensor:
    """x [M, K] · w [N, K] → [M, N] in x's dtype (products in fp32)."""
    return F.linear(x.float(), w.float()).to(x.dtype)


def experts_gemv(x: Tensor, w: Tensor, ids: Tensor, grouped: bool = False) -> Tensor:
    """x [B, X, K], w [E, N, K], ids [B, C] → [B, C, N]: each row's chosen experts."""
    xs = _chosen_rows(x.float(), ids)  # [B, C, K]
    return torch.einsum("bck,bcnk->bcn", xs, w[ids].float()).to(x.dtype)


def rows_q8(x: Tensor, w: Tensor, grouped: bool = False) -> Tensor:
    """x [M, K] · q8_0 w [N, nb · 34] → [M, N] in x's dtype: x rounded to int16 per block, w dequantized."""
    return F.linear(round_to_q16(x), dequantize_q8_0(w, x.shape[-1])).to(x.dtype)


def experts_q8(x: Tensor, w: Tensor, ids: Tensor, grouped: bool = False) -> Tensor:
    """experts_gemv on q8_0 stacks [E, N, nb · 34]."""
    xs = round_to_q16(_chosen_rows(x, ids))  # [B, C, K]
    E, N, width = w.shape
    dense = dequantize_q8_0(w.reshape(E * N, width), x.shape[-1]).view(E, N, -1)  # [E, N, K]
    return torch.einsum("bck,bcnk->bcn", xs, dense[ids]).to(x.dtype)


def rows_argmax(x: Tensor) -> Tensor:
    """x [M, V] → [M] int64, the first of equal maxima (the first NaN)."""
    return x.argmax(dim=-1)


def transpose_into(src: Tensor, out: Tensor) -> None:
    """out [C, R] = src [R, C] transposed."""
    out.copy_(src.t())


def latent_attend(query: Tensor, cached: Tensor, visible: Tensor, scale: float, r: int) -> Tensor:
    """query [B, H, C'] fp32, cached [B, S, C] (C >= C'), visible [B, S] → [B, H, r] fp32: MLA's
    softmax(q · cached[..., :C']) · cached[..., :r] over the visible positions."""
    scores = torch.einsum("bhc,bsc->bhs", query, cached[..., : query.shape[-1]].float()) * scale
    probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhs,bsr->bhr", probs, cached[..., :r].float())


def attend(query: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """query [B, Hkv, G, D] fp32, keys, values [B, Hkv, S, D], allowed [B, S] → [B, Hkv, G, D] fp32."""
    scores = torch.einsum("bkgd,bksd->bkgs", query, keys.float()) * scale
    probs = torch.softmax(scores.masked_fill(~allowed[:, None, None, :], float("-inf")), dim=-1)
    return torch.einsum("bkgs,bksd->bkgd", probs, values.float())


def rows_tiles(x: Tensor, w: Tensor) -> Tensor:
    """rows_gemv on a bf16 weight in the tiles layout."""
    return rows_gemv(x, from_tiles(w))


def experts_tiles(x: Tensor, w: Tensor, ids: Tensor) -> Tensor:
    """experts_gemv on bf16 stacks in the tiles layout."""
    return experts_gemv(x, from_tiles(w), ids)


def bf16_tiles() -> bool:
    """The reference never multiplies on AMX tiles."""
    return False


def mxfp4_gemv(x: Tensor, packed: Tensor) -> Tensor:
    """x [M, K] fp32 or bf16 · MXFP4 prepared rows [N, G · 17] → [M, N] fp32: the weight dequantized
    exactly, the products and sums in fp32 (a bf16 x widened: the operator's bf16 pair products)."""
    return packed_layout.mxfp4_apply(x.float(), packed)


def fp8_gemv(x: Tensor, packed: Tensor, block: int, lut: Tensor) -> Tensor:
    """x [M, K] fp32 · FP8 prepared rows [N, K + 4 · nbc] → [M, N] fp32 (lut: each code's value)."""
    return packed_layout.fp8_apply(x, packed, None, block)


def experts_mxfp4(x: Tensor, w: Tensor, ids: Tensor) -> Tensor:
    """x [B, X, K] fp32 or bf16, MXFP4 prepared stacks [E, N, G · 17], ids [B, C] → [B, C, N] fp32: each
    row's chosen experts, each dequantized and multiplied as mxfp4_gemv's reference does."""
    return _packed_experts(x.float(), w, ids, lambda rows, packed: packed_layout.mxfp4_apply(rows, packed))


def experts_fp8(x: Tensor, w: Tensor, ids: Tensor, block: int) -> Tensor:
    """experts_mxfp4 on FP8 prepared stacks [E, N, K + 4 · nbc] (column blocks `block` wide)."""
    return _packed_experts(x, w, ids, lambda rows, packed: packed_layout.fp8_apply(rows, packed, None, block))


def _packed_experts(x: Tensor, w: Tensor, ids: Tensor, apply) -> Tensor:
    xs = _chosen_rows(x, ids)  # [B, C, K]
    out = [[apply(xs[b, c][None], w[e])[0] for c, e in enumerate(row)] for b, row in enumerate(ids.tolist())]
    return torch.stack([torch.stack(row) for row in out]) if out else x.new_empty((0, ids.shape[1], w.shape[1]))


# Every operator's reference by its plain name (moekit.ops.OPERATORS).
REFERENCES = {f.__name__: f for f in (rows_gemv, experts_gemv, rows_q8, experts_q8, rows_argmax, transpose_into, latent_attend,
                                      attend, rows_tiles, experts_tiles, bf16_tiles, mxfp4_gemv, fp8_gemv, experts_mxfp4,
                                      experts_fp8)}
