"""Kernels whose weight stays as published: MXFP4 (gpt-oss) and block-scaled FP8 (DeepSeek-V3, Kimi-K2).

The prepared weight is one uint8 tensor with each row's scales beside its codes, so selecting,
reordering or stacking rows (gpt-oss's interleaved gate/up, DeepSeek's separate gate and up) is a
plain row copy of packed bytes:

  mxfp4  [out, G · 17]            per 32 inputs: the E8M0 scale byte, then 16 bytes of FP4 codes:
                                  exactly the stored bytes, 4.25 bits a weight.
  fp8    [out, in + 4 · nbc]      the row's `in` float8_e4m3fn codes, then the fp32 scales of the
                                  nbc column blocks of its block row: 8 + 32 / bi bits a weight
                                  (8.25 for 128-wide blocks; the file keeps one scale per block,
                                  this keeps one per block and row so that rows stay independent).

apply: dequantize the weight in use (exactly, as transformers does: fp8 × scale in fp32; FP4 ×
2^e) to the activations' dtype and F.linear — the plain reference, one expert at a time, so only
that expert is ever at full precision. hub: the dequantized fp32 weight [out, in].
moekit::mxfp4_gemv / fp8_gemv (csrc/packed.cpp, through moekit.ops) multiply the same prepared bytes without expanding them (few rows).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moekit.weights import fp8, mxfp4

MXFP4_ROW_BLOCK = 1 + mxfp4.BLOCK_BYTES  # 17 bytes per 32 inputs


def mxfp4_rows(blocks: Tensor, scales: Tensor) -> Tensor:
    """Stored blocks uint8 [R, G, 16] + scales uint8 [R, G] → the prepared [R, G · 17]."""
    rows, groups, _ = blocks.shape
    return torch.cat((scales.unsqueeze(-1), blocks), dim=-1).reshape(rows, groups * MXFP4_ROW_BLOCK)


def mxfp4_dequantize(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """Prepared [out, G · 17] → [out, G · 32] in `dtype`, exactly: each code byte's two values are
    a table row (one gather per byte, F.embedding), each block's 2^(s − 127) a table entry, and an
    FP4 value × a power of two is exact in fp32 and bf16 alike."""
    b = packed.view(packed.shape[0], -1, MXFP4_ROW_BLOCK)  # [out, G, 17]
    pairs, powers = _tables(dtype)
    values = F.embedding(b[..., 1:].int(), pairs)  # [out, G, 16, 2]
    scale = powers[b[..., 0].int()]  # [out, G]
    return values.flatten(-2).mul_(scale.unsqueeze(-1)).view(packed.shape[0], -1)


@lru_cache(maxsize=None)
def _tables(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """byte → its two FP4 values [256, 2], and E8M0 byte → 2^(s − 127) [256], in `dtype` (exact:
    bf16 has fp32's exponent range, subnormals included)."""
    powers = torch.ldexp(torch.ones(256), torch.arange(256) - mxfp4.SCALE_BIAS)
    return mxfp4.PAIRS.to(dtype), powers.to(dtype)


def mxfp4_hub(packed: Tensor, in_features: int = 0) -> Tensor:
    """Prepared [out, G · 17] → fp32 [out, G · 32]."""
    return mxfp4_dequantize(packed, torch.float32)


def mxfp4_prepare(weight: Tensor) -> Tensor:
    """A Hub weight [out, in] quantized to MXFP4 here (tests; checkpoints arrive packed)."""
    blocks, scales = mxfp4.quantize(weight)
    return mxfp4_rows(blocks, scales)


def mxfp4_apply(x: Tensor, packed: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [.., in] → [.., out]: the weight dequantized to x's dtype (exact), then F.linear."""
    w = mxfp4_dequantize(packed, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def fp8_rows(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """Stored weight float8_e4m3fn [out, in] + scale_inv [nbr, nbc] → the prepared [out, in + 4 · nbc]."""
    out_features = weight.shape[0]
    per_row = scale_inv.float().repeat_interleave(block[0], dim=0)[:out_features].contiguous()  # [out, nbc]
    return torch.cat((weight.view(torch.uint8), per_row.view(torch.uint8)), dim=1)


def _fp8_split(packed: Tensor, in_features: int) -> tuple[Tensor, Tensor]:
    codes = packed[:, :in_features].view(torch.float8_e4m3fn)  # [out, in]
    scales = packed[:, in_features:].contiguous().view(torch.float32)  # [out, nbc]
    return codes, scales


def fp8_hub(packed: Tensor, in_features: int, block_in: int) -> Tensor:
    """Prepared [out, in + 4 · nbc] → fp32 [out, in]: code × its block's scale, in fp32 as
    transformers computes it (a bf16 engine then casts, as transformers' bf16 load does)."""
    codes, scales = _fp8_split(packed, in_features)
    w = codes.to(torch.float32)  # [out, in]
    full = in_features // block_in
    if full:
        w[:, : full * block_in].view(-1, full, block_in).mul_(scales[:, :full, None])  # no expanded scale copy
    if full * block_in < in_features:
        w[:, full * block_in :].mul_(scales[:, full:])
    return w


def fp8_apply(x: Tensor, packed: Tensor, bias: Optional[Tensor], block_in: int) -> Tensor:
    w = fp8_hub(packed, x.shape[-1], block_in).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def fp8_prepare(weight: Tensor, block_in: int) -> Tensor:
    """A Hub weight [out, in] quantized to FP8 in block_in² blocks here (tests; checkpoints arrive packed)."""
    block = (block_in, block_in)
    return fp8_rows(*fp8.quantize(weight, block), block)
