"""Weight-only 4-bit (q4_0 blocks): the quantizer bit for bit against llama.cpp's own Python
quantizer (gguf-py), the round trip within its bound, and the reference kernel's product."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moekit.model import int4
from moekit.model.linear import INT4


def _weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=gen) / in_f**0.5


def test_a_block_is_a_float16_scale_and_16_bytes_of_nibbles():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16], w[0, 1] = -0.8, 0.33, 0.7  # m = -0.8: d = 0.1, codes 0, 11.8 → 11, 15.5 → 15
    packed = int4.quantize_q4_0(w)
    assert packed.shape == (1, 18) and packed.dtype == torch.uint8
    assert packed[0, :2].view(torch.float16).item() == pytest.approx(0.1, rel=1e-3)
    codes = packed[0, 2:]
    assert codes[0].item() == 0 | (11 << 4)  # element 0 low nibble, element 16 high nibble
    assert codes[1].item() & 0x0F == 15  # 0.7 / 0.1 + 8.5 = 15.5, truncated
    assert all(c & 0x0F == 8 for c in codes[2:].tolist())  # zeros sit on code 8


def test_the_blocks_are_what_llama_cpp_writes():
    gguf = pytest.importorskip("gguf")
    w = _weight(24, 96, seed=3)
    theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(int4.quantize_q4_0(w).numpy(), theirs)


def test_a_zero_block_has_scale_zero_and_dequantizes_to_zero():
    packed = int4.quantize_q4_0(torch.zeros(3, 64))
    assert torch.equal(int4.dequantize_q4_0(packed, 64), torch.zeros(3, 64))


@pytest.mark.parametrize("in_f", [64, 52, 224], ids=["whole-blocks", "padded", "demo-width"])
def test_the_round_trip_is_within_half_a_step_and_a_clamped_step(in_f):
    w = _weight(40, in_f, seed=1)
    got = int4.dequantize_q4_0(int4.quantize_q4_0(w), in_f)
    assert got.shape == w.shape
    padded = torch.nn.functional.pad(w, (0, -in_f % 32)).view(40, -1, 32)
    step = (padded.abs().amax(-1) / 8).repeat_interleave(32, dim=1)[:, :in_f]  # |d|
    err = (got - w).abs()
    fp16 = 8 * step * 2**-11 + 1e-7  # the float16 scale's rounding, at the largest code
    assert (err <= step + fp16).all()  # the clamp at code 15 costs at most a whole step
    # ... and only values of the other sign beyond 7.5 steps are clamped: the rest round to half a step.
    assert (err[w.abs() < 7.5 * step] <= step[w.abs() < 7.5 * step] / 2 + fp16[w.abs() < 7.5 * step]).all()
    assert err.mean() < 0.3 * step.mean()


def test_the_reference_kernel_is_the_dequantized_weights_product():
    w, x = _weight(48, 52, seed=2), _weight(5, 52, seed=4)
    packed = INT4.prepare(w)
    want = torch.nn.functional.linear(x, int4.dequantize_q4_0(packed, 52))
    assert torch.equal(INT4.apply(x, packed, None), want)
    assert INT4.apply(x.bfloat16(), packed, None).dtype == torch.bfloat16
    assert torch.equal(INT4.hub(packed, 52), int4.dequantize_q4_0(packed, 52))
