"""int8 weights with one scale per 32 inputs: GGUF's q8_0 block, quantized once at load.

A weight [out, in] becomes bytes [out, nb * 34], nb = ceil(in / 32): per row, nb blocks of a
float16 scale d then 32 int8 q, as llama.cpp lays q8_0 out (the last block of a row whose `in` is
not a multiple of 32 is padded with zeros). d = max|w| / 127 over the block and q = round(w / d),
half away from zero: bit for bit what gguf-py's Q8_0 writes. Inside a product, each block of 32
activations is rounded to int16 with one fp32 scale (`round_to_q16`: relative error at most 2^-16
of the block's largest |x|, 128 times finer than a bf16 activation), so that a block's 32 products
are one exact integer sum: half the vector work of widening every code to float. Products are
accumulated in fp32 and cast back to the engine's dtype.

  int8_reference   x rounded as above, the whole weight dequantized to fp32, F.linear: what the
                   kernels must equal.
  q8 gemv          moekit::rows_q8, a small C++ operator (moekit.model.gemv, built once per machine
                   with -march=native, cached by torch): reads the 34-byte blocks and multiplies
                   them with the rounded x in integers, without materialising the weight; up to GEMV_ROWS rows of x, threads over
                   `out`. The compiled decode step calls the same operator (and experts_q8).
  dequantize+mm    the reference's arithmetic; used for more rows (prefill), and everywhere when
                   the operator cannot be built here (no compiler) or measures slower.

Which of the two runs one-row products is measured once per process (`choose_gemv`), never
assumed from the CPU. tests/model/test_int8.py holds the kernel to the reference.
"""

from __future__ import annotations

import time
from functools import lru_cache, partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 32
BLOCK_BYTES = 2 + BLOCK  # float16 scale, then 32 int8
GEMV_ROWS = 16  # x rows up to which the operator runs; more rows amortise a dequantized weight
PROBE_ROWS = 1024  # choose_gemv times at most this many output rows: the per-row cost is what differs


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


def int8_reference(x: Tensor, packed: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [.., in] → [.., out] in x's dtype: x rounded by blocks, the dequantized weight, F.linear in fp32."""
    w = dequantize_q8_0(packed, x.shape[-1])
    y = F.linear(round_to_q16(x), w, None if bias is None else bias.float())
    return y.to(x.dtype)


@lru_cache(maxsize=1)
def gemv_operator():
    """moekit::rows_q8 (moekit.model.gemv, the operator the compiled decode step calls too), with
    the build and the row grouping measured fastest here (gemv.variant), or None where it cannot be built
    (the reason is in `gemv_status`)."""
    from moekit.model import gemv

    ops = gemv.operators()
    if ops is None:
        _STATUS["gemv"] = gemv.status().replace("gemv operators", "q8 operator")
        return None
    chosen = gemv.variant("q8_0")
    return partial(gemv.op(chosen.namespace, "rows_q8"), grouped=chosen.grouped)


_STATUS: dict[str, str] = {}


def int8_gemv(x: Tensor, packed: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """The operator on ≤ GEMV_ROWS rows (else the reference's dequantize + matmul)."""
    op = gemv_operator()
    x2 = x.reshape(-1, x.shape[-1])
    if op is None or x2.shape[0] > GEMV_ROWS:
        return int8_reference(x, packed, bias)
    y = op(x2.float(), packed)  # [M, out] fp32; the operator pads x to whole blocks
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], packed.shape[0])


def mean_time(fn, *args, repeats: int = 10) -> float:
    """Seconds per call of fn(*args), after one untimed call (kernel choice at load)."""
    fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats


@lru_cache(maxsize=None)
def choose_gemv(in_features: int, out_features: int, dtype: torch.dtype) -> str:
    """'gemv' or 'reference': whichever runs one row of this shape faster here, measured once per
    process on up to PROBE_ROWS of its output rows (best of three alternating rounds, so a noisy
    neighbour hurts both alike)."""
    if gemv_operator() is None:
        return "reference"
    gen = torch.Generator().manual_seed(0)
    packed = quantize_q8_0(torch.randn(min(out_features, PROBE_ROWS), in_features, generator=gen))
    x = torch.randn(1, in_features, generator=gen).to(dtype)
    with torch.inference_mode():
        rounds = [(mean_time(int8_gemv, x, packed), mean_time(int8_reference, x, packed)) for _ in range(3)]
    fast, plain = min(r[0] for r in rounds), min(r[1] for r in rounds)
    return "gemv" if fast < plain else "reference"


def gemv_status() -> str:
    return _STATUS.get("gemv", "the q8 operator is built" if gemv_operator() is not None else "")


def quantize_decoder(decoder, experts_only: bool = False) -> str:
    """After loading and preparing: the routed experts (and, unless experts_only, every other
    projection) as q8_0 blocks. Routers stay at the dtype (they choose; a flip changes the experts),
    and so do the embedding, norms and MLA's per-head kv_b halves. Returns what was done, in words."""
    from moekit.model.experts import RoutedExperts
    from moekit.model.linear import Linear
    from moekit.model.moe import Router

    counts = {"experts": 0, "linears": 0}
    with torch.inference_mode(False):
        for sub in list(decoder.modules()):
            if isinstance(sub, RoutedExperts):
                sub.quantize_int8()  # paged experts: a no-op, the store quantizes them as they load
                counts["experts"] += 1
            elif isinstance(sub, Linear) and not isinstance(sub, Router) and not experts_only and sub.out_features > 1:
                sub.quantize_int8()
                counts["linears"] += 1
    what = f"int8 weights (q8_0 blocks of {BLOCK}): routed experts of {counts['experts']} layers"
    if not experts_only:
        what += f" and {counts['linears']} other projections"
    status = gemv_status()
    return what + (f"; {status}" if status else "")
