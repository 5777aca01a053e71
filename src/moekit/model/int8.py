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
  q8 gemv          moekit::rows_q8, a small C++ operator (moekit.ops, built once per machine
                   and CPU from csrc/q8.cpp): reads the 34-byte blocks and multiplies
                   them with the rounded x in integers, without materialising the weight; up to GEMV_ROWS rows of x, threads over
                   `out`. The compiled decode step calls the same operator (and experts_q8).
  dequantize+mm    the reference's arithmetic; used for more rows (prefill), and everywhere when
                   the operator cannot be built here (no compiler) or measures slower.

Which of the two runs one-row products is measured once per machine and persisted (`choose_gemv`),
never assumed from the CPU. tests/model/test_int8.py holds the kernel to the reference.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moekit import ops
from moekit.ops.select import mean_time
from moekit.ops.q8_0 import BLOCK, BLOCK_BYTES, dequantize_q8_0, quantize_q8_0, round_to_q16  # noqa: F401 (the layout, re-used here)

GEMV_ROWS = 16  # x rows up to which the operator runs; more rows amortise a dequantized weight
PROBE_ROWS = 1024  # choose_gemv times at most this many output rows: the per-row cost is what differs


def int8_reference(x: Tensor, packed: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [.., in] → [.., out] in x's dtype: x rounded by blocks, the dequantized weight, F.linear in fp32."""
    w = dequantize_q8_0(packed, x.shape[-1])
    y = F.linear(round_to_q16(x), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def gemv_operator():
    """moekit::rows_q8 of the build and row grouping chosen for q8_0 weights here (moekit.ops.variant),
    or None where this process has not loaded the operators (--kernels reference, a failed build)."""
    if not ops.available("rows_q8"):
        return None
    chosen = ops.variant("q8_0")
    return partial(ops.op(chosen.namespace, "rows_q8"), grouped=chosen.grouped)


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


@lru_cache(maxsize=None)
def choose_gemv(in_features: int, out_features: int, dtype: torch.dtype) -> str:
    """'gemv' or 'reference': whichever runs one row of this shape faster here, measured once per
    machine on up to PROBE_ROWS of its output rows (best of three alternating rounds, so a noisy
    neighbour hurts both alike) and persisted (moekit.ops.operator_wins)."""

    def timing() -> tuple[float, float]:
        gen = torch.Generator().manual_seed(0)
        packed = quantize_q8_0(torch.randn(min(out_features, PROBE_ROWS), in_features, generator=gen))
        x = torch.randn(1, in_features, generator=gen).to(dtype)
        with torch.inference_mode():
            rounds = [(mean_time(int8_gemv, x, packed), mean_time(int8_reference, x, packed)) for _ in range(3)]
        return min(r[0] for r in rounds), min(r[1] for r in rounds)

    return "gemv" if ops.operator_wins("q8_0", in_features, out_features, dtype, timing) else "reference"


def gemv_status() -> str:
    return "the q8 operator is loaded" if gemv_operator() is not None else "the q8 operator is not loaded: the reference runs"


def quantized_linear(module) -> bool:
    """Whether `--weights int8` makes this module's weight q8_0 blocks: every Linear but the routers
    and one-output projections (quantize_decoder, and the loader that quantizes as it reads)."""
    from moekit.model.linear import Linear
    from moekit.model.moe import Router

    return isinstance(module, Linear) and not isinstance(module, Router) and module.out_features > 1


def quantize_decoder(decoder, experts_only: bool = False) -> str:
    """After loading and preparing: the routed experts (and, unless experts_only, every other
    projection) as q8_0 blocks. Routers stay at the dtype (they choose; a flip changes the experts),
    and so do the embedding, norms and MLA's per-head kv_b halves. Returns what was done, in words."""
    from moekit.model.experts import RoutedExperts

    counts = {"experts": 0, "linears": 0}
    with torch.inference_mode(False):
        for sub in list(decoder.modules()):
            if isinstance(sub, RoutedExperts):
                sub.quantize_int8()  # paged experts: a no-op, the store quantizes them as they load
                counts["experts"] += 1
            elif not experts_only and quantized_linear(sub):
                sub.quantize_int8()  # a no-op for one the loader already made int8 (moekit.model.loading)
                counts["linears"] += 1
    what = f"int8 weights (q8_0 blocks of {BLOCK}): routed experts of {counts['experts']} layers"
    if not experts_only:
        what += f" and {counts['linears']} other projections"
    status = gemv_status()
    return what + (f"; {status}" if status else "")
