"""Block-scaled FP8 as DeepSeek-V3 and Kimi-K2 publish it.

A linear weight `X.weight` [out, in] is `float8_e4m3fn`, and `X.weight_scale_inv` fp32
[ceil(out / bo), ceil(in / bi)] holds one multiplier per bo × bi block (`weight_block_size`,
[128, 128] in every published checkpoint): w = fp8 value × scale of its block. The name says
"inverse" because the quantizer divided by it. A shape that is not a multiple of the block leaves
partial blocks at the bottom and right edges; they still take one scale each (hence the ceil).

In DeepSeek-V3 every projection is FP8 — attention (q_a/q_b/kv_a/kv_b/o_proj), the dense and
shared MLPs and every routed expert — except the router (`mlp.gate`), norms, the embedding and
the head, which stay bf16.

`dequantize` is transformers' `Fp8Dequantize` arithmetic (fp8 → fp32, times the fp32 scale, then
cast), written from the format's definition so that partial blocks work too (transformers'
requires whole blocks). `quantize` writes test and benchmark checkpoints: scale = max|w| / 448.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid a weight [out, in] needs: one entry per block, partial ones included."""
    out_features, in_features = shape
    return cdiv(out_features, block[0]), cdiv(in_features, block[1])


def expand_scales(scale_inv: Tensor, shape: tuple[int, int], block: tuple[int, int]) -> Tensor:
    """scale_inv [nbr, nbc] → fp32 [out, in], each block's scale over its elements."""
    out_features, in_features = shape
    rows = scale_inv.float().repeat_interleave(block[0], dim=0)[:out_features]
    return rows.repeat_interleave(block[1], dim=1)[:, :in_features]


def dequantize(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """weight float8_e4m3fn [out, in], scale_inv [ceil(out/bo), ceil(in/bi)] → [out, in] in `dtype`."""
    shape = tuple(weight.shape)
    return (weight.to(torch.float32) * expand_scales(scale_inv, shape, block)).to(dtype)


def quantize(weight: Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[Tensor, Tensor]:
    """weight [out, in] → (float8_e4m3fn [out, in], fp32 scale_inv [ceil(out/bo), ceil(in/bi)])."""
    w = weight.detach().float()
    nbr, nbc = scale_shape(tuple(w.shape), block)
    padded = torch.zeros(nbr * block[0], nbc * block[1])
    padded[: w.shape[0], : w.shape[1]] = w
    amax = padded.view(nbr, block[0], nbc, block[1]).abs().amax(dim=(1, 3))  # [nbr, nbc]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / expand_scales(scale, tuple(w.shape), block)).to(torch.float8_e4m3fn)
    return q, scale
