"""MXFP4 as gpt-oss publishes it: FP4 E2M1 values two to a byte, one E8M0 scale per 32 values.

The OCP microscaling format. A block of 32 weights along the input dimension is 16 bytes of 4-bit
codes (element 2i in the LOW nibble of byte i, 2i+1 in the high one) and one scale byte s meaning
2^(s − 127): 17 bytes per 32 weights, 4.25 bits each. A code is sign (bit 3) and a 3-bit magnitude
index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

gpt-oss stores each expert projection as `<name>_blocks` uint8 [E, R, G, 16] and `<name>_scales`
uint8 [E, R, G], R the projection's output rows and G = in / 32 — the [out, in] orientation of a
Linear, i.e. the TRANSPOSE of the bf16 checkpoint's `gate_up_proj` [E, D, 2F] / `down_proj` [E, F, D]
(x @ W). transformers' `convert_moe_packed_tensors` dequantizes and transposes back; `dequantize_stack`
here gives exactly its values (every FP4 value times a power of two is exact in fp32 and bf16).

`quantize` is the inverse used to write test and benchmark checkpoints: per block the smallest
power-of-two scale that brings max|w| within 6, then round to the nearest code.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32  # weights per scale
BLOCK_BYTES = BLOCK // 2  # packed codes per block
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127  # E8M0: 2^(byte − 127)


def _pair_table() -> Tensor:
    """byte → its two values (low nibble first), so decoding is one gather per byte."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)  # [256, 2]


PAIRS = _pair_table()


def dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] → [..., G * 32] in `dtype` (exact)."""
    values = PAIRS[blocks.long()].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def dequantize_stack(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """gpt-oss experts: blocks [E, R, G, 16], scales [E, R, G] → the bf16 layout [E, G * 32, R]."""
    return dequantize(blocks, scales, dtype).transpose(1, 2).contiguous()


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [..., K] (K a multiple of 32) → (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32])."""
    *lead, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {BLOCK}, got {k}")
    w = weight.detach().float().reshape(*lead, k // BLOCK, BLOCK)  # [..., G, 32]
    amax = w.abs().amax(dim=-1)  # [..., G]
    # Smallest e with amax / 2^e ≤ 6 (the largest FP4 magnitude); an all-zero block takes e = −127.
    e = torch.ceil(torch.log2(amax / 6)).clamp(-SCALE_BIAS, 127)
    e = torch.where(amax > 0, e, torch.full_like(e, -SCALE_BIAS))
    scaled = torch.ldexp(w.abs(), -e.to(torch.int32).unsqueeze(-1))  # [..., G, 32] within [0, 6]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    index = (scaled.unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # [..., G, 32] nearest magnitude
    codes = (index | ((w < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    scales = (e + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
