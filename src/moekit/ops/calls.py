"""The operators as the model calls them eagerly: each takes the operator where this process has it
registered and the shape is its, else the reference (moekit.ops.reference), with the same result up
to the order of fp32 sums (bit for bit for argmax and the copy); except rows_gemv / experts_gemv,
the ROWS kernel's products, which a decoder runs only where its command loaded the operators (so
what it sums does not depend on what else the process registered)."""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moekit.ops import packed_layout, reference
from moekit.ops.runtime import available, namespaces, op
from moekit.ops.select import kind_of, mean_time, operator_wins, variant
from moekit.ops.shims import C_ARGS, ShimTable, declaration

GEMV_ROWS = 16  # x rows up to which the FP8 operator runs; more rows amortise a dequantized weight
# MXFP4's operator expands each weight row once for all its x rows: against the dequantized weight
# and F.linear on gpt-oss-20b's [5760, 2880] at bf16, 2 threads, it was 4.7x as fast at 16 rows,
# 1.3x at 64 and 0.77x at 128 (2026-12-05, load ~10).
MXFP4_ROWS = 64
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # code → value (exact)


def rows_argmax(logits: Tensor) -> Tensor:
    """torch.argmax(logits, dim=-1), the same indices (the first of equal maxima, the first NaN), for
    fp32 [B, V] CPU logits: by moekit::rows_argmax where registered. Greedy decoding's token: 3.6
    against 33 µs for one row of 32k here (measured)."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and not logits.requires_grad and available("rows_argmax")):
        return op("moekit", "rows_argmax")(logits)
    return reference.rows_argmax(logits)


def is_transpose(view: Tensor) -> bool:
    """Whether view is a contiguous matrix's transpose (what moekit::transpose_into writes out)."""
    return view.dim() == 2 and view.stride() == (1, view.shape[0])


def copy_into(out: Tensor, view: Tensor) -> Tensor:
    """out.copy_(view), the same values; where view is a contiguous fp32 or bf16 matrix's
    transpose, out is fp32 and contiguous and the operator is registered, by moekit::transpose_into
    (a bf16 [1024, 512] widened and transposed in 0.16 against 0.56 ms on one core here, measured)."""
    if (is_transpose(view) and view.dtype in (torch.float32, torch.bfloat16)
            and out.dtype == torch.float32 and out.shape == view.shape and out.is_contiguous()
            and view.device.type == out.device.type == "cpu" and available("transpose_into")):
        op("moekit", "transpose_into")(view.t(), out)
        return out
    return out.copy_(view)


def rows_gemv(x: Tensor, w: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [.., in] · w [out, in]ᵀ + bias → [.., out] in x's dtype, for fp32 / bf16 weights in the Hub
    layout as the ROWS kernel runs them (moekit.model.linear): moekit::rows_gemv of the build chosen
    for w's kind (select.variant) on up to GEMV_ROWS rows, F.linear on more (a prompt's GEMM, where
    the BLAS is faster). The rows are never widened to fp32 (select.widen_batch is the compiled
    step's choice): each row's floats are then a lone row's whatever rows are beside it (tests/ops),
    so an expert's output is the same alone, in a batch, in the expert-parallel layer and through
    experts_gemv below. Called only where the command loaded the operators."""
    x2 = x.reshape(-1, x.shape[-1])
    if not 0 < x2.shape[0] <= GEMV_ROWS:
        return F.linear(x, w, bias)
    choice = variant(kind_of(w))
    y = op(choice.namespace, "rows_gemv")(x2, w, choice.grouped)
    return (y if bias is None else y + bias).view(*x.shape[:-1], w.shape[0])


def experts_gemv(x: Tensor, stack: Tensor, ids: Tensor) -> Tensor:
    """x [B, 1 or K, in] through the chosen experts ids [B, K] of a stack [E, out, in] (fp32 / bf16,
    the Hub layout) → [B, K, out] in x's dtype, read in place: moekit::experts_gemv as the ROWS kernel
    runs it eagerly, each (row, expert) product rows_gemv's above bit for bit (never widened)."""
    choice = variant(kind_of(stack))
    return op(choice.namespace, "experts_gemv")(x, stack, ids, choice.grouped)


def _packed_fits(x2: Tensor, packed: Tensor, name: str, rows: int) -> bool:
    return x2.shape[0] <= rows and packed.is_contiguous() and packed.device.type == "cpu" and available(name)


def _mxfp4_input(x: Tensor) -> Tensor:
    """x as the MXFP4 operators take it: bf16 as it is (their bf16 pair product, where built: the same
    products as on x widened), anything else as fp32."""
    return x if x.dtype == torch.bfloat16 else x.float()


def mxfp4_gemv(x: Tensor, packed: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [.., in] → [.., out] for MXFP4 prepared rows: the operator on ≤ MXFP4_ROWS rows, else the reference."""
    x2 = x.reshape(-1, x.shape[-1])
    if not _packed_fits(x2, packed, "mxfp4_gemv", MXFP4_ROWS):
        return packed_layout.mxfp4_apply(x, packed, bias)
    y = op("moekit", "mxfp4_gemv")(_mxfp4_input(x2), packed)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], packed.shape[0])


def fp8_gemv(x: Tensor, packed: Tensor, bias: Optional[Tensor], block_in: int) -> Tensor:
    """x [.., in] → [.., out] for FP8 prepared rows: the operator on ≤ GEMV_ROWS rows, else the reference."""
    x2 = x.reshape(-1, x.shape[-1])
    if not _packed_fits(x2, packed, "fp8_gemv", GEMV_ROWS):
        return packed_layout.fp8_apply(x, packed, bias, block_in)
    y = op("moekit", "fp8_gemv")(x2.float().contiguous(), packed, block_in, FP8_VALUES)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], packed.shape[0])


def packed_experts_operator(block_in: int) -> str:
    """The operator that reads stacked packed experts: MXFP4 (block_in 0) or FP8 (column blocks block_in wide)."""
    return "experts_fp8" if block_in else "experts_mxfp4"


def packed_experts(x: Tensor, stack: Tensor, ids: Tensor, bias: Optional[Tensor], block_in: int) -> Tensor:
    """x [B, 1 or K, in] through the chosen experts ids [B, K] of a stack of packed rows [E, out, bytes]
    (MXFP4 for block_in 0, else FP8 in column blocks block_in wide) plus each one's bias [E, out]
    → [B, K, out] in x's dtype: mxfp4_gemv / fp8_gemv on each chosen expert (the products in fp32,
    the bias added in fp32, then cast), by moekit::experts_mxfp4 / experts_fp8 where registered, else
    the reference."""
    name = packed_experts_operator(block_in)
    extra = (block_in,) if block_in else ()
    run = op("moekit", name) if available(name) else getattr(reference, name)
    y = run(x.float() if block_in else _mxfp4_input(x), stack, ids, *extra)  # [B, K, out] fp32
    if bias is not None:
        y = y + bias[ids].float()
    return y.to(x.dtype)


@lru_cache(maxsize=None)
def packed_operator_wins(in_features: int, out_features: int, dtype: torch.dtype, block_in: int = 0) -> bool:
    """Whether the MXFP4 (block_in 0) or FP8 (column blocks block_in wide) operator runs one row of
    this shape faster than the reference here (best of three alternating rounds; measured once per
    machine and persisted, moekit.ops.select.operator_wins)."""

    def timing() -> tuple[float, float]:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(min(out_features, 1024), in_features, generator=gen)
        x = torch.randn(1, in_features, generator=gen).to(dtype)
        if block_in:
            w = packed_layout.fp8_prepare(w, block_in)
            fast, plain = (lambda: fp8_gemv(x, w, None, block_in)), (lambda: packed_layout.fp8_apply(x, w, None, block_in))
        else:
            w = packed_layout.mxfp4_prepare(w)
            fast, plain = (lambda: mxfp4_gemv(x, w)), (lambda: packed_layout.mxfp4_apply(x, w))
        with torch.inference_mode():
            rounds = [(mean_time(fast), mean_time(plain)) for _ in range(3)]
        return min(r[0] for r in rounds), min(r[1] for r in rounds)

    what = f"fp8-{block_in}" if block_in else "mxfp4"
    return operator_wins(what, in_features, out_features, dtype, timing)


def c_shims() -> dict:
    """Inductor's aot_inductor.custom_ops_to_c_shims for the registered builds: each operator → the
    declaration of its C entry point (csrc/shims.cpp), which the generated C++ then calls directly."""
    from moekit.ops.runtime import suffix

    return ShimTable({op(space, name).default: [declaration(name, suffix(space))] for space in namespaces() for name in C_ARGS})
