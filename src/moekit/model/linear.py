"""Projections (x Wᵀ + b) with the weight laid out once, after loading, for the fastest GEMM at hand.

A Kernel is data: how to lay a Hub weight [out, in] out (`prepare`) and how to apply it (`apply`).
`kernel_for(weight)` picks one from the weight's device, dtype and shape; `linear_reference`
(F.linear on the Hub layout) is what every kernel must equal — tests/model/test_linear.py checks it.

  plain       F.linear on [out, in]: the reference, and the fallback (CUDA, fp16, no oneDNN).
  rows        fp32 and bf16 on CPU where the command loaded moekit's operators (`operators`: the
              commands' `--kernels auto`): the Hub layout, moekit::rows_gemv on up to 16 rows (a
              decode step's, an expert's share of a prompt), F.linear on more (moekit.ops.rows_gemv);
              the decode step reads expert stacks in place with experts_gemv, the same floats. One
              row from memory 2-3× F.linear and the transposed / oneDNN layouts at fp32 and bf16
              (measured on one thread). Another summation order (~1e-7 relative at fp32). Chosen at
              prepare time from what the command asked for, not from what this process has
              registered: one command sums the same way in every process.
  transposed  fp32 on CPU: the weight stored [in, out] contiguous, x @ Wt. On one core MKL's one-row
              GEMM streams a cold weight faster the longer its contiguous rows are (measured; each row
              start seems to cost a prefetch ramp), so [in, out] when out ≥ in (2.4× F.linear on a
              32000 × 512 LM head, 1.2–2.3× on expert-sized matrices) and the Hub's [out, in] when
              in > out (a 512 × 1024 gate_up: F.linear 16 GB/s, x @ Wt 12.5). Same products, another
              summation order (~1e-7 relative).
  onednn      bf16 on CPU: oneDNN's blocked layout (`_reorder_linear_weight`) and its packed GEMM,
              1.4–1.8× F.linear in bf16 at every shape measured, and bit for bit the same result
              (F.linear is oneDNN too).
  tiles       bf16 on a CPU with AMX, for the compiled decode step only (moekit.model.compiled_step
              lays a bf16 decoder's projections and expert stacks out so): moekit::rows_tiles on blocks
              of 16 rows stored tile by tile (moekit.ops.to_tiles), same shape as the Hub weight;
              a batch's products stream it ~20% faster than the Hub layout, one row's ~10% (measured).
              Another summation order than F.linear's (fp32 chains over 32-input steps).
  int8        int8 weights in q8_0 blocks (moekit.model.int8), by request only (`--weights int8`),
              the activations rounded to int16 per block of 32 inside the product: its reference
              rounds them, dequantizes the weight and runs F.linear in fp32; int8-gemv is a compiled operator
              for few rows, chosen per shape by measuring which of the two is faster here.
  int4        weight-only 4-bit in q4_0 blocks (moekit.model.int4): dequantize + F.linear in fp32;
              written by `moekit pack --precision int4` (or a profile's cold experts) only.
  mxfp4, fp8  weights kept as published (moekit.ops.packed_layout): gpt-oss's MXFP4 and DeepSeek's
              block-scaled FP8 routed experts, dequantized per use (exactly) and F.linear;
              mxfp4-gemv, fp8-gemv (moekit.ops.fp8_gemv) read the packed rows in a compiled few-row
              product, chosen per shape by measuring, as int8-gemv is.

`Kernel.hub` gives a prepared weight back in the Hub layout [out, in], exactly (int8 and int4 excepted),
so a prepared model can still be quantized after loading.

Only the prepared layout stays in memory: preparing replaces the weight, it never keeps both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit import ops
from moekit.model import int4, int8
from moekit.ops import packed_layout as packed
from moekit.ops.torch_private import onednn_bf16_supported, onednn_linear, onednn_reorder


def linear_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [.., in], weight [out, in] (the Hub layout) → [.., out]."""
    return F.linear(x, weight, bias)


def _transpose(weight: Tensor) -> Tensor:
    return weight.t().contiguous()  # [in, out]


def _apply_transposed(x: Tensor, weight_t: Tensor, bias: Optional[Tensor]) -> Tensor:
    if bias is None:
        return x @ weight_t
    if x.dim() == 2:
        return torch.addmm(bias, x, weight_t)
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight_t).view(*x.shape[:-1], -1)


def _apply_tiles(x: Tensor, tiled: Tensor, bias: Optional[Tensor]) -> Tensor:
    rows = ops.op("moekit", "rows_tiles") if ops.available("rows_tiles") else ops.reference.rows_tiles
    y = rows(x.reshape(-1, x.shape[-1]), tiled).view(*x.shape[:-1], -1)
    return y if bias is None else y + bias


def _pack(weight: Tensor) -> Tensor:
    # The batch-size hint 1 tunes the blocking for decode; larger M (prefill, batch 8) still works.
    return onednn_reorder(weight)


def _apply_packed(x: Tensor, packed: Tensor, bias: Optional[Tensor]) -> Tensor:
    return onednn_linear(x, packed, bias)


def _unpack(packed: Tensor, in_features: int) -> Tensor:
    """The Hub weight back from oneDNN's layout: I · Wᵀ, each output one product with 1 (exact)."""
    eye = torch.eye(in_features, dtype=packed.dtype)
    return _apply_packed(eye, packed, None).t().contiguous()


@dataclass(frozen=True)
class Kernel:
    name: str
    prepare: Callable[[Tensor], Tensor]  # Hub weight [out, in] → the layout `apply` reads
    apply: Callable[[Tensor, Tensor, Optional[Tensor]], Tensor]  # (x [.., in], prepared, bias) → [.., out]
    hub: Callable[[Tensor, int], Tensor] = lambda w, in_features: w  # (prepared, in) → Hub weight [out, in]
    # The prepared layout as a view of the Hub weight, where one exists: `prepare` is then a
    # contiguous copy of it, which a caller may instead write into a buffer it owns, casting as it
    # copies (the expert store's slots).
    layout: Optional[Callable[[Tensor], Tensor]] = None


PLAIN = Kernel("plain", lambda w: w, linear_reference, layout=lambda w: w)
ROWS = Kernel("rows", lambda w: w, ops.rows_gemv, layout=lambda w: w)
TRANSPOSED = Kernel("transposed", _transpose, _apply_transposed, lambda w, in_features: w.t(), layout=lambda w: w.t())
ONEDNN = Kernel("onednn", _pack, _apply_packed, _unpack)
TILES = Kernel("tiles", ops.to_tiles, _apply_tiles, lambda w, in_features: ops.from_tiles(w))


INT8 = Kernel("int8", int8.quantize_q8_0, int8.int8_reference, int8.dequantize_q8_0)
INT8_GEMV = Kernel("int8-gemv", int8.quantize_q8_0, int8.int8_gemv, int8.dequantize_q8_0)
# q4_0 blocks (moekit.model.int4): only the reference so far; the expert store runs cold experts with it.
INT4 = Kernel("int4", int4.quantize_q4_0, int4.int4_reference, int4.dequantize_q4_0)


# Weights kept as published (moekit.ops.packed_layout): gpt-oss's MXFP4 experts, DeepSeek's FP8 experts.
MXFP4 = Kernel("mxfp4", packed.mxfp4_prepare, packed.mxfp4_apply, packed.mxfp4_hub)
MXFP4_GEMV = Kernel("mxfp4-gemv", packed.mxfp4_prepare, ops.mxfp4_gemv, packed.mxfp4_hub)


def mxfp4_kernel_for(in_features: int, out_features: int, dtype: torch.dtype) -> Kernel:
    """The compiled MXFP4 operator where it measured faster for one row of this shape, else the reference."""
    return MXFP4_GEMV if ops.packed_operator_wins(in_features, out_features, dtype) else MXFP4


def fp8_kernel(block_in: int = 128, gemv: bool = False) -> Kernel:
    """The block-scaled FP8 kernel for column blocks `block_in` wide (128 in every published
    checkpoint): the reference, or with gemv the compiled operator (moekit.ops.fp8_gemv).
    One Kernel per (block_in, gemv), however the arguments are spelled."""
    return _fp8_kernel(int(block_in), bool(gemv))


@lru_cache(maxsize=None)
def _fp8_kernel(block_in: int, gemv: bool) -> Kernel:
    apply = ops.fp8_gemv if gemv else packed.fp8_apply
    return Kernel(
        f"fp8-{block_in}" + ("-gemv" if gemv else ""),
        lambda w: packed.fp8_prepare(w, block_in),
        lambda x, w, bias: apply(x, w, bias, block_in),
        lambda w, in_features: packed.fp8_hub(w, in_features, block_in),
    )


def fp8_kernel_for(in_features: int, out_features: int, dtype: torch.dtype, block_in: int = 128) -> Kernel:
    """The compiled FP8 operator where it measured faster for one row of this shape, else the reference."""
    return fp8_kernel(block_in, ops.packed_operator_wins(in_features, out_features, dtype, block_in))


def int8_kernel_for(weight: Tensor, dtype: torch.dtype) -> Kernel:
    """The int8 kernel for a Hub weight [out, in] whose activations are `dtype`: the operator
    where it measured faster than the reference for one row of this shape, else the reference."""
    out_features, in_features = weight.shape
    return INT8_GEMV if int8.choose_gemv(in_features, out_features, dtype) == "gemv" else INT8

# What each dtype runs on a CPU; anything missing here, and every other device, runs PLAIN.
CPU_KERNELS: dict[torch.dtype, Kernel] = {torch.float32: TRANSPOSED, torch.bfloat16: ONEDNN}
ROWS_DTYPES = (torch.float32, torch.bfloat16)  # the weights moekit::rows_gemv reads


def _onednn_bf16() -> bool:
    return onednn_bf16_supported()


def kernel_for(weight: Tensor, operators: bool = False) -> Kernel:
    """The kernel a Hub-layout weight [out, in] should run with, by its device, dtype and shape, and
    whether the command loaded moekit's operators (ROWS for fp32 and bf16 on CPU)."""
    if weight.device.type != "cpu":
        return PLAIN
    if operators and weight.dtype in ROWS_DTYPES:
        return ROWS
    kernel = CPU_KERNELS.get(weight.dtype, PLAIN)
    if kernel is ONEDNN and not _onednn_bf16():
        return PLAIN
    out_features, in_features = weight.shape
    if kernel is TRANSPOSED and in_features > out_features:
        return PLAIN  # the Hub's rows are the longer ones
    return kernel


class Linear(nn.Module):
    """nn.Linear's parameters, in the Hub layout until `prepare` swaps the weight for the kernel's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = PLAIN

    def prepare(self, kernel: Kernel) -> None:
        if self.kernel is not PLAIN:
            raise RuntimeError("Linear.prepare called twice: the Hub layout is gone")
        if kernel is PLAIN:
            return
        # Rebinding drops the last reference to the Hub-layout weight: one layout resident.
        self.weight = nn.Parameter(kernel.prepare(self.weight.detach()), requires_grad=False)
        self.kernel = kernel

    def quantize_int8(self) -> None:
        """Replace the weight (in whatever layout) by its q8_0 blocks; activations keep their dtype."""
        if self.kernel in (INT8, INT8_GEMV):
            return
        hub = self.kernel.hub(self.weight.detach(), self.in_features)
        kernel = int8_kernel_for(hub, hub.dtype)
        self.weight = nn.Parameter(kernel.prepare(hub), requires_grad=False)
        self.kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel.apply(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in={self.in_features}, out={self.out_features}, bias={bias}, kernel={self.kernel.name}"


def prepare_linears(module: nn.Module, operators: bool = False) -> None:
    """Prepare every Linear under `module`, each with the kernel its weight calls for (operators:
    whether the command loaded moekit's operators)."""
    for sub in module.modules():
        if isinstance(sub, Linear) and sub.kernel is PLAIN:
            sub.prepare(kernel_for(sub.weight, operators))
