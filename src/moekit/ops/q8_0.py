"""The q8_0 layout the int8 operators read (GGUF's block: a float16 scale d, then 32 int8 q), and the
rounding of x to int16 per block that makes a block's 32 products one exact integer sum.

A weight [out, in] becomes bytes [out, nb * 34], nb = ceil(in / 32) (the last block of a row whose
`in` is not a multiple of 32 padded with zeros); d = max|w| / 127 over the block and q = round(w / d),
half away from zero: bit for bit what gguf-py's Q8_0 writes. moekit.model.int8 uses it as a weight
form; moekit.ops.reference multiplies it the plain way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 32
BLOCK_BYTES = 2 + BLOCK  # float16 scale, then 32 int8


def quantize_q8_0(weight: Tensor) -> Tensor:
    """weight [out, in] (any float dtype) → uint8 [out, nb * 34], q8_0 blocks along `in`."""
    out_features, in_features = weight.shape
    nb = -(-in_features // BLOCK)
    w = weight.detach().to(torch.float32, copy=True)  # worked on in place below
    if nb * BLOCK != in_features:
        w = F.pad(w, (0, nb * BLOCK - in_features))
    blocks = w.view(out_features, nb, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True).div_(127)  # [out, nb, 1]
    blocks.mul_(torch.where(d == 0, torch.zeros_like(d), 1 / d))
    q = blocks.add_(torch.copysign(torch.full_like(blocks, 0.5), blocks)).trunc_().to(torch.int8)  # roundf
    packed = torch.empty(out_features, nb, BLOCK_BYTES, dtype=torch.uint8)
    packed[..., :2] = d.to(torch.float16).view(torch.uint8)
    packed[..., 2:] = q.view(torch.uint8)
    return packed.view(out_features, nb * BLOCK_BYTES)


def dequantize_q8_0(packed: Tensor, in_features: int) -> Tensor:
    """uint8 [out, nb * 34] → fp32 [out, in_features]."""
    out_features = packed.shape[0]
    blocks = packed.view(out_features, -1, BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [out, nb, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [out, nb, 32]
    return (q * d).view(out_features, -1)[:, :in_features]


Q16_MAX = 32767


def round_to_q16(x: Tensor) -> Tensor:
    """x [.., in] → fp32 [.., in]: each block of 32 inputs as s · q, s = max|x| / 32767 and q = x / s
    rounded to nearest even, as moekit::rows_q8 rounds it (a block of zeros stays zero)."""
    width = x.shape[-1]
    nb = -(-width // BLOCK)
    blocks = F.pad(x.float(), (0, nb * BLOCK - width)).unflatten(-1, (nb, BLOCK))  # [.., nb, 32]
    s = blocks.abs().amax(dim=-1, keepdim=True) / Q16_MAX
    q = torch.where(s == 0, torch.zeros_like(blocks), torch.round(blocks / s))
    return (q * s).flatten(-2)[..., :width]
