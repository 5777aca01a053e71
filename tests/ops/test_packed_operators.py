"""moekit::mxfp4_gemv / fp8_gemv (csrc/packed.cpp) of each build against moekit.ops.reference, and the
eager helpers (moekit.ops.mxfp4_gemv / fp8_gemv) that take them for few rows: the same products in
another summation order."""

from __future__ import annotations

import pytest
import torch

from moekit import ops as door
from moekit.ops import packed_layout, reference
from moekit.ops.calls import FP8_VALUES


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert (got.float() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_mxfp4_operator_is_the_reference_within_summation_order(ops, rows):
    w = packed_layout.mxfp4_prepare(torch.randn(72, 160) * torch.logspace(-2, 2, 160))  # 5 blocks a row
    x = torch.randn(rows, 160)
    got = ops.mxfp4_gemv(x, w)
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    _close(got, reference.mxfp4_gemv(x, w), 1e-6)


@pytest.mark.parametrize("shape", [(72, 160), (130, 300), (40, 72)])
def test_fp8_operator_is_the_reference_within_summation_order(ops, shape):
    w = packed_layout.fp8_prepare(torch.randn(shape) * torch.logspace(-2, 2, shape[1]), 128)
    x = torch.randn(3, shape[1])
    got = ops.fp8_gemv(x, w, 128, FP8_VALUES)
    assert got.shape == (3, shape[0])
    _close(got, reference.fp8_gemv(x, w, 128, FP8_VALUES), 1e-6)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_the_eager_helpers_are_the_layouts_apply_with_a_bias(machine_builds, dtype, tol):
    """With the operators loaded the helpers take them for ≤ 16 rows and the reference for more."""
    w = packed_layout.mxfp4_prepare(torch.randn(72, 160))
    f = packed_layout.fp8_prepare(torch.randn(72, 160), 128)
    for rows in (1, 20):
        x, bias = torch.randn(rows, 160).to(dtype), torch.randn(72).to(dtype)
        got = door.mxfp4_gemv(x, w, bias)
        assert got.dtype == dtype
        _close(got, packed_layout.mxfp4_apply(x.float(), w, bias.float()), tol)
        _close(door.fp8_gemv(x, f, bias, 128), packed_layout.fp8_apply(x.float(), f, bias.float(), 128), tol)
