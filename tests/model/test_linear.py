"""The projection kernels against F.linear, and preparation keeping exactly one layout of each weight."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from moekit.model.linear import ONEDNN, PLAIN, ROWS, TILES, TRANSPOSED, Linear, kernel_for, linear_reference
from moekit.ops.torch_private import onednn_bf16_supported

ONEDNN_BF16 = onednn_bf16_supported()


@pytest.fixture(autouse=True, scope="module")
def operators_loaded():
    """The operators loaded, as a run that uses them loads them: TILES then runs moekit::rows_tiles."""
    from moekit import ops

    assert ops.load().ok, ops.load().failures()
needs_onednn = pytest.mark.skipif(not ONEDNN_BF16, reason="this CPU build has no oneDNN bf16")

# (kernel, dtype, relative tolerance): transposed sums in another order; oneDNN is F.linear's own backend.
KERNELS = [
    pytest.param(TRANSPOSED, torch.float32, 1e-6, id="transposed-fp32"),
    pytest.param(ONEDNN, torch.bfloat16, 2**-8, id="onednn-bf16", marks=needs_onednn),
    pytest.param(PLAIN, torch.float32, 0.0, id="plain-fp32"),
    # moekit::rows_tiles (built by the set-up): the product rounded to bf16, then the bias added (the
    # compiled step's order), so a bias makes two roundings
    pytest.param(TILES, torch.bfloat16, 2**-7, id="tiles-bf16"),
]


def _weights(out_f: int, in_f: int, bias: bool, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)
    b = torch.randn(out_f, generator=gen).to(dtype) if bias else None
    return w, b


@pytest.mark.parametrize("kernel,dtype,rel", KERNELS)
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (2, 5, 96)], ids=["one-row", "prefill", "batch-time"])
@pytest.mark.parametrize("bias", [False, True])
def test_prepared_kernel_equals_f_linear(kernel, dtype, rel, shape, bias):
    w, b = _weights(160, 96, bias, dtype, seed=len(shape) + bias)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = linear_reference(x, w, b).float()
    got = kernel.apply(x, kernel.prepare(w), b)
    assert got.shape == want.shape and got.dtype == dtype
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= rel * scale + 1e-7


def test_kernel_choice_per_device_dtype_and_shape():
    def weight(out_f, in_f, dtype=torch.float32, device="cpu"):
        return torch.empty(out_f, in_f, dtype=dtype, device=device)

    assert kernel_for(weight(32000, 512)) is TRANSPOSED  # LM head: [in, out] rows are the long ones
    assert kernel_for(weight(512, 512)) is TRANSPOSED
    assert kernel_for(weight(512, 1024)) is PLAIN  # the Hub's rows are longer
    assert kernel_for(weight(32, 512)) is PLAIN  # a router: F.linear, as the reference scores
    assert kernel_for(weight(512, 1024, torch.bfloat16)) is (ONEDNN if ONEDNN_BF16 else PLAIN)
    assert kernel_for(weight(512, 512, torch.float16)) is PLAIN
    assert kernel_for(weight(512, 512, device="meta")) is PLAIN  # anything but a CPU keeps F.linear


def test_a_command_that_loaded_the_operators_gets_the_rows_kernel_for_fp32_and_bf16():
    """Told the command loaded them: fp32 and bf16 weights of every shape keep the Hub layout for
    moekit::rows_gemv (ROWS); fp16 and other devices are as without them."""
    def weight(out_f, in_f, dtype=torch.float32, device="cpu"):
        return torch.empty(out_f, in_f, dtype=dtype, device=device)

    for shape in ((32000, 512), (512, 1024), (32, 512)):
        assert kernel_for(weight(*shape), operators=True) is ROWS
        assert kernel_for(weight(*shape, torch.bfloat16), operators=True) is ROWS
    assert kernel_for(weight(512, 512, torch.float16), operators=True) is PLAIN
    assert kernel_for(weight(512, 512, device="meta"), operators=True) is PLAIN


@pytest.mark.parametrize(
    "kernel,dtype", [(TRANSPOSED, torch.float32), pytest.param(ONEDNN, torch.bfloat16, marks=needs_onednn)]
)
def test_linear_prepare_drops_the_hub_layout(kernel, dtype):
    layer = Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(3, 64).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
        want = layer(x)
    hub = weakref.ref(layer.weight)
    layer.prepare(kernel)
    gc.collect()
    assert hub() is None, "the [out, in] weight is still alive next to the prepared one"
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="twice"):
        layer.prepare(kernel)


@pytest.mark.parametrize("kernel", [TRANSPOSED, PLAIN], ids=["transposed", "plain"])
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32], ids=["from-bf16", "from-fp32"])
def test_a_copy_of_the_layout_view_is_the_prepared_weight(kernel, stored):
    # The expert store writes layout(w) into a slot it owns, casting as it copies: that slot must be
    # bit for bit what prepare would have made of the weight cast first.
    w, _ = _weights(48, 64, False, stored, seed=5)
    slot = torch.full(kernel.prepare(w).shape, float("nan"))
    slot.copy_(kernel.layout(w))
    want = kernel.prepare(w.float())
    assert slot.is_contiguous() and torch.equal(slot, want)
    assert ONEDNN.layout is None  # a blocked layout is no view of the Hub weight
