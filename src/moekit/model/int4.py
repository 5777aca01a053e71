"""Weight-only 4-bit with one scale per 32 inputs: GGUF's q4_0 block, for the coldest experts.

A weight [out, in] becomes bytes [out, nb * 18], nb = ceil(in / 32): per row, nb blocks of a
float16 scale d then 16 bytes of codes, as llama.cpp lays q4_0 out (a row whose `in` is not a
multiple of 32 is padded with zeros). Byte j of a block holds element j in its low nibble and
element j + 16 in its high one. d = m / -8, m the block's value of largest magnitude with its
sign, and q = min(15, trunc(w / d + 8.5)): bit for bit llama.cpp's quantize_row_q4_0_ref, so the
extreme lands on code 0 exactly and the range [-8d, 7d] is used whole. w ≈ (q - 8) · d.

Error bound (tests/model/test_int4.py): |w - ŵ| ≤ |d| / 2 for every element but those the clamp
at 15 cuts (values of the other sign than m, beyond 7.5|d|), where it is ≤ |d|, d = amax / 8;
plus the float16 rounding of d (a relative 2^-11 of each ŵ).

  int4_reference   dequantize to fp32 and F.linear: the only kernel so far (speed is secondary:
                   these are the experts a token rarely reaches).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 32
BLOCK_BYTES = 2 + BLOCK // 2  # float16 scale, then 16 bytes of two 4-bit codes each


def quantize_q4_0(weight: Tensor) -> Tensor:
    """weight [out, in] (any float dtype) → uint8 [out, nb * 18], q4_0 blocks along `in`."""
    out_features, in_features = weight.shape
    nb = -(-in_features // BLOCK)
    w = weight.detach().to(torch.float32, copy=True)
    if nb * BLOCK != in_features:
        w = F.pad(w, (0, nb * BLOCK - in_features))
    blocks = w.view(out_features, nb, BLOCK)
    where = blocks.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes, as the C loop
    d = blocks.gather(-1, where).div_(-8)  # [out, nb, 1], signed
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (blocks * inv).add_(8.5).trunc_().clamp_(max=15).to(torch.uint8)  # [out, nb, 32] in 0..15
    packed = torch.empty(out_features, nb, BLOCK_BYTES, dtype=torch.uint8)
    packed[..., :2] = d.to(torch.float16).view(torch.uint8)
    packed[..., 2:] = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return packed.view(out_features, nb * BLOCK_BYTES)


def dequantize_q4_0(packed: Tensor, in_features: int) -> Tensor:
    """uint8 [out, nb * 18] → fp32 [out, in_features]."""
    out_features = packed.shape[0]
    blocks = packed.view(out_features, -1, BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [out, nb, 1]
    codes = blocks[..., 2:]
    q = torch.cat((codes & 0x0F, codes >> 4), dim=-1).float().sub_(8)  # [out, nb, 32]
    return (q * d).view(out_features, -1)[:, :in_features]


def int4_reference(x: Tensor, packed: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [.., in] → [.., out] in x's dtype: the dequantized weight, F.linear in fp32."""
    w = dequantize_q4_0(packed, x.shape[-1])
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)
