"""The MXFP4 and FP8 kernels (moekit.ops.packed_layout) against the obvious: dequantize the stored
weight by the format's definition, then F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moekit.ops import packed_layout as packed
from moekit.model.linear import MXFP4, fp8_kernel
from moekit.weights import fp8, mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_kernel_is_dequantize_then_linear(dtype):
    w = torch.randn(48, 96)
    blocks, scales = mxfp4.quantize(w)
    prepared = packed.mxfp4_rows(blocks, scales)
    assert prepared.shape == (48, 3 * 17) and torch.equal(prepared, MXFP4.prepare(w))
    want_w = mxfp4.dequantize(blocks, scales)  # [out, in]
    assert torch.equal(MXFP4.hub(prepared, 96), want_w)
    x, bias = torch.randn(5, 96).to(dtype), torch.randn(48).to(dtype)
    assert torch.equal(MXFP4.apply(x, prepared, bias), F.linear(x, want_w.to(dtype), bias))


@pytest.mark.parametrize("shape", [(256, 128), (200, 300), (96, 136), (130, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernel_is_dequantize_then_linear(shape, dtype):
    w = torch.randn(shape)
    q, scale_inv = fp8.quantize(w)
    prepared = packed.fp8_rows(q, scale_inv, (128, 128))
    kernel = fp8_kernel(128)
    assert prepared.shape == (shape[0], shape[1] + 4 * -(-shape[1] // 128))
    want_w = fp8.dequantize(q, scale_inv)
    assert torch.equal(kernel.hub(prepared, shape[1]), want_w)
    x = torch.randn(3, shape[1]).to(dtype)
    assert torch.equal(kernel.apply(x, prepared, None), F.linear(x, want_w.to(dtype)))


def test_stacked_rows_keep_their_own_scales():
    """gate_up is gate's rows then up's: each row carries its block row's scales, so stacking the
    packed rows is stacking the dequantized weights."""
    gate, up = torch.randn(96, 192), torch.randn(96, 192) * 100
    rows = [packed.fp8_rows(*fp8.quantize(m), (128, 128)) for m in (gate, up)]
    both = fp8_kernel(128).hub(torch.cat(rows), 192)
    assert torch.equal(both, torch.cat([fp8.dequantize(*fp8.quantize(m)) for m in (gate, up)]))


def test_one_gpt_oss_expert_becomes_our_gate_then_up_rows():
    """packed_loading.mxfp4_expert (the resident load's and the expert store's) against the
    format's definition: gpt_oss's bf16 gate_up [D, 2F] has gate at even and up at odd columns, so
    ours [2F, D] is its even columns then its odd ones, transposed."""
    from moekit.model.packed_loading import mxfp4_expert

    d, f = 64, 32
    hub_gate_up, hub_down = torch.randn(d, 2 * f), torch.randn(f, d)  # x @ W, as gpt_oss stores them
    up_blocks, up_scales = mxfp4.quantize(hub_gate_up.t())  # [2F, D/32, 16]: the published rows
    down_blocks, down_scales = mxfp4.quantize(hub_down.t())
    gate_up, down = mxfp4_expert(up_blocks, up_scales, down_blocks, down_scales)
    stored = mxfp4.dequantize(up_blocks, up_scales).t()  # back to the Hub's [D, 2F]
    want = torch.cat((stored[:, 0::2].t(), stored[:, 1::2].t()))  # gate rows, then up rows
    assert gate_up.shape == (2 * f, d // 32 * 17) and torch.equal(MXFP4.hub(gate_up, d), want)
    assert torch.equal(MXFP4.hub(down, f), mxfp4.dequantize(down_blocks, down_scales))
