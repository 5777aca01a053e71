"""int8 weights (q8_0 blocks): the quantizer's arithmetic, the activations' int16 rounding, the fast
operator against the dequantize-and-matmul reference, exact layout round trips, and an int8 engine end to end."""

from __future__ import annotations

import pytest
import torch

from moekit.model import int8
from moekit.model.linear import INT8, INT8_GEMV, ONEDNN, PLAIN, TRANSPOSED, Linear
from moekit.ops.torch_private import onednn_bf16_supported

ONEDNN_BF16 = onednn_bf16_supported()



@pytest.fixture(autouse=True, scope="module")
def operators_loaded():
    """The operator loaded, as a run with int8 weights loads it (moekit.engine.loader.load_kernels):
    without it int8_gemv is the reference, and these tests would hold the reference to itself."""
    from moekit import ops

    assert ops.load().ok, ops.load().failures()

def _weight(out_f: int, in_f: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)


def test_a_block_is_a_float16_scale_and_32_rounded_codes():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([1.27, -0.635, 0.005, 0.015])  # d = 0.01: codes 127, -63.5 → -64, 0.5 → 1, 1.5 → 2
    packed = int8.quantize_q8_0(w)
    assert packed.shape == (1, 34) and packed.dtype == torch.uint8
    d = packed[0, :2].view(torch.float16).item()
    q = packed[0, 2:].view(torch.int8)
    assert d == pytest.approx(0.01, rel=1e-3)
    assert q[:4].tolist() == [127, -64, 1, 2]  # half away from zero, as llama.cpp's roundf
    assert q[4:].abs().sum() == 0


def test_a_zero_block_has_scale_zero_and_dequantizes_to_zero():
    packed = int8.quantize_q8_0(torch.zeros(3, 64))
    assert torch.equal(int8.dequantize_q8_0(packed, 64), torch.zeros(3, 64))


@pytest.mark.parametrize("in_f", [64, 52, 96], ids=["whole-blocks", "padded", "three-blocks"])
def test_dequantized_weight_is_within_half_a_step_of_the_original(in_f):
    # Half a step from rounding, plus the float16 scale's own rounding (≤ 2⁻¹¹ relative) × 127.
    w = _weight(40, in_f)
    got = int8.dequantize_q8_0(int8.quantize_q8_0(w), in_f)
    assert got.shape == w.shape
    padded = torch.nn.functional.pad(w, (0, -in_f % 32)).view(40, -1, 32)
    step = (padded.abs().amax(-1) / 127).repeat_interleave(32, dim=1)[:, :in_f]
    assert ((got - w).abs() <= step * (0.5 + 127 * 2**-11) + 1e-7).all()


@pytest.mark.parametrize("in_f", [64, 52], ids=["whole-blocks", "padded"])
def test_activations_are_rounded_within_half_a_q16_step_per_block(in_f):
    x = torch.randn(5, in_f, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, in_f)
    x[1, :32] = 0  # a zero block stays zero (scale 0, no division)
    got = int8.round_to_q16(x)
    assert got.shape == x.shape and torch.equal(got[1, :32], torch.zeros(32))
    padded = torch.nn.functional.pad(x, (0, -in_f % 32)).view(5, -1, 32)
    step = (padded.abs().amax(-1) / 32767).repeat_interleave(32, dim=1)[:, :in_f]
    assert ((got - x).abs() <= step * 0.5 * (1 + 2**-20)).all()
    assert ((got - x).abs() <= 2**-16 * padded.abs().amax(-1).repeat_interleave(32, dim=1)[:, :in_f]).all()


def test_the_operator_rounds_activations_exactly_as_the_reference():
    """A weight that is the identity with scale 1 makes each output one rounded input: the
    operator's rounding, bit for bit, against round_to_q16."""
    k = 96
    codes = torch.eye(k).view(k, k // 32, 32).to(torch.int8)
    packed = torch.empty(k, k // 32, 34, dtype=torch.uint8)
    packed[..., :2] = torch.ones(k, k // 32, 1, dtype=torch.float16).view(torch.uint8)
    packed[..., 2:] = codes.view(torch.uint8)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)) * 10
    got = int8.int8_gemv(x, packed.view(k, -1))
    assert torch.equal(got, int8.round_to_q16(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 8, 12], ids=["one-row", "three", "gemv-max", "dequantized"])
@pytest.mark.parametrize("in_f", [96, 52], ids=["whole-blocks", "padded"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_operator_equals_the_dequantize_and_matmul_reference(dtype, rows, in_f, bias):
    packed = int8.quantize_q8_0(_weight(200, in_f, seed=rows))
    b = torch.randn(200, generator=torch.Generator().manual_seed(1)).to(dtype) if bias else None
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = int8.int8_reference(x, packed, b)
    got = int8.int8_gemv(x, packed, b)
    assert got.dtype == dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: both round an fp32 sum once, maybe apart by one ulp
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


def test_the_operator_is_loaded_here():
    # A machine without a compiler falls back to the reference (and says so); this one has one.
    assert int8.gemv_operator() is not None, int8.gemv_status()


@pytest.mark.parametrize("kernel, dtype", [(PLAIN, torch.float32), (TRANSPOSED, torch.float32),
                                           pytest.param(ONEDNN, torch.bfloat16, marks=pytest.mark.skipif(
                                               not ONEDNN_BF16, reason="no oneDNN bf16 on this CPU"))])
def test_every_prepared_layout_gives_the_hub_weight_back_exactly(kernel, dtype):
    w = _weight(48, 64, dtype=dtype)
    assert torch.equal(kernel.hub(kernel.prepare(w), 64), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_prepared_linear_quantizes_to_what_its_hub_weight_quantizes_to(dtype):
    w = _weight(48, 64, dtype=dtype)
    lin = Linear(64, 48, bias=False)
    lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    from moekit.model.linear import kernel_for

    lin.prepare(kernel_for(lin.weight))
    lin.quantize_int8()
    assert lin.kernel in (INT8, INT8_GEMV)
    assert torch.equal(lin.weight, int8.quantize_q8_0(w))
    x = torch.randn(2, 64, dtype=dtype)
    assert torch.equal(lin(x), lin.kernel.apply(x, lin.weight, None))
