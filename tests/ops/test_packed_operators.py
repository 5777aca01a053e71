"""moekit::mxfp4_gemv / fp8_gemv and their stacked experts' forms experts_mxfp4 / experts_fp8
(csrc/packed.cpp) of each build against moekit.ops.reference, and the eager helpers (moekit.ops.mxfp4_gemv /
fp8_gemv, packed_experts) that take them: the same products in another summation order."""

from __future__ import annotations

import pytest
import torch

from moekit import ops as door
from moekit.ops import packed_layout, reference
from moekit.ops.calls import FP8_VALUES


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert (got.float() - want).abs().max().item() <= tol * want.abs().max().item()


# x fp32 (an fp32 model's activations) and bf16 (a bf16 model's, multiplied as bf16 pairs where built).
X_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_mxfp4_operator_is_the_reference_within_summation_order(ops, rows, dtype):
    w = packed_layout.mxfp4_prepare(torch.randn(72, 160) * torch.logspace(-2, 2, 160))  # 5 blocks a row
    x = torch.randn(rows, 160).to(dtype)
    got = ops.mxfp4_gemv(x, w)
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    _close(got, reference.mxfp4_gemv(x, w), 1e-6)


@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 7, 40])
@pytest.mark.parametrize("inputs", [320, 288])
def test_mxfp4_rows_together_are_each_rows_product_alone_bit_for_bit(ops, rows, dtype, inputs):
    """Several rows (a prompt's, routed to one expert) expand each weight row once for all of them
    (up to 4 a pass); every row's outputs are still its one-row product to the bit, so batching
    changes no float. 10 and 9 blocks a row: 2 and 1 past the last whole round of the 4 chains."""
    w = packed_layout.mxfp4_prepare(torch.randn(41, inputs) * torch.logspace(-2, 2, inputs))  # an odd row count
    x = torch.randn(rows, inputs).to(dtype)
    got = ops.mxfp4_gemv(x, w)
    for r in range(rows):
        assert torch.equal(got[r], ops.mxfp4_gemv(x[r : r + 1], w)[0])
    _close(got, reference.mxfp4_gemv(x, w), 1e-6)


@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("inputs", [320, 288])
def test_mxfp4_one_row_outputs_do_not_depend_on_the_weight_rows_beside_them(ops, dtype, inputs):
    """One x row takes several weight rows a pass (an AVX-512 build: 4); each output is still that
    weight row's product alone (a weight of one row, which no pass groups), bit for bit, in the rows
    operator and in the experts' (an expert one row chose), wherever the row falls in a pass or a thread's span."""
    w = packed_layout.mxfp4_prepare(torch.randn(41, inputs) * torch.logspace(-2, 2, inputs))  # passes of 4 and a last row
    x = torch.randn(1, inputs, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = ops.mxfp4_gemv(x, w)
    alone = torch.stack([ops.mxfp4_gemv(x, w[o : o + 1])[0, 0] for o in range(41)])
    assert torch.equal(got[0], alone)
    stack = torch.stack([w[:40], w[1:]])  # 40 rows an expert: blocks of 16, 16 and 8
    experts = ops.experts_mxfp4(x[:, None], stack, torch.tensor([[1, 0]]))
    assert torch.equal(experts[0, 0], alone[1:]) and torch.equal(experts[0, 1], alone[:40])
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
    """With the operators loaded the helpers take them for ≤ 64 rows (MXFP4) or ≤ 16 (FP8) and the
    reference for more."""
    w = packed_layout.mxfp4_prepare(torch.randn(72, 160))
    f = packed_layout.fp8_prepare(torch.randn(72, 160), 128)
    for rows in (1, 20, 70):
        x, bias = torch.randn(rows, 160).to(dtype), torch.randn(72).to(dtype)
        got = door.mxfp4_gemv(x, w, bias)
        assert got.dtype == dtype
        _close(got, packed_layout.mxfp4_apply(x.float(), w, bias.float()), tol)
        _close(door.fp8_gemv(x, f, bias, 128), packed_layout.fp8_apply(x.float(), f, bias.float(), 128), tol)


def _stack(prepare, experts: int, out: int, inputs: int) -> torch.Tensor:
    """[E, out, bytes]: experts of very different scales per input, prepared one by one."""
    gen = torch.Generator().manual_seed(1)
    return torch.stack([prepare(torch.randn(out, inputs, generator=gen) * torch.logspace(-2, 2, inputs)) for _ in range(experts)])


PACKED_STACKS = {
    "mxfp4": (lambda w: packed_layout.mxfp4_prepare(w), 160, 0),
    "fp8": (lambda w: packed_layout.fp8_prepare(w, 128), 300, 128),  # a partial last column block
}


@pytest.mark.parametrize("kind", sorted(PACKED_STACKS))
@pytest.mark.parametrize("rows, per_choice", [(1, False), (3, False), (2, True)])
def test_the_experts_operators_are_the_rows_operator_on_each_chosen_expert(ops, kind, rows, per_choice):
    """Each (row, choice)'s output is, bit for bit, the rows operator's on that expert (the same dot
    per weight row), and the reference's within summation order; x holds one row per token or one
    per choice (llama4's input-weighed experts)."""
    prepare, inputs, block = PACKED_STACKS[kind]
    stack = _stack(prepare, 5, 40, inputs)
    ids = torch.tensor([[4, 0, 2], [2, 2, 1], [0, 3, 4]])[:rows]  # a row may choose an expert twice
    x = torch.randn(rows, 3 if per_choice else 1, inputs)
    if kind == "mxfp4":
        got, want = ops.experts_mxfp4(x, stack, ids), reference.experts_mxfp4(x, stack, ids)
        one = lambda xr, e: ops.mxfp4_gemv(xr, stack[e])  # noqa: E731
    else:
        got, want = ops.experts_fp8(x, stack, ids, block), reference.experts_fp8(x, stack, ids, block)
        one = lambda xr, e: ops.fp8_gemv(xr, stack[e], block, FP8_VALUES)  # noqa: E731
    assert got.shape == (rows, 3, 40) and got.dtype == torch.float32
    for b in range(rows):
        for c in range(3):
            assert torch.equal(got[b, c], one(x[b, c if per_choice else 0][None], int(ids[b, c]))[0])
    _close(got, want, 1e-6)


@pytest.mark.parametrize("dtype", X_DTYPES)
def test_the_mxfp4_experts_operator_on_a_prompt_is_each_rows_one_row_product(ops, dtype):
    """A prompt's rows share experts (up to 9 rows an expert here, past the 4-row passes): each
    (row, choice) is still the one-row product of that expert, bit for bit."""
    stack = _stack(PACKED_STACKS["mxfp4"][0], 3, 24, 160)
    ids = torch.randint(0, 3, (13, 2), generator=torch.Generator().manual_seed(2))
    x = torch.randn(13, 1, 160).to(dtype)
    got = ops.experts_mxfp4(x, stack, ids)
    for b in range(13):
        for c in range(2):
            assert torch.equal(got[b, c], ops.mxfp4_gemv(x[b], stack[int(ids[b, c])])[0])
    _close(got, reference.experts_mxfp4(x, stack, ids), 1e-6)


@pytest.mark.parametrize("dtype", X_DTYPES)
def test_the_mxfp4_experts_operator_at_four_rows_is_each_rows_one_row_product(ops, dtype):
    """A decode step serving 4 requests: their top-4 choices share experts, 1, 2, 3 and 4 rows an
    expert (each in one pass over its weight); each (row, choice) is the one-row product, bit for bit."""
    stack = _stack(PACKED_STACKS["mxfp4"][0], 8, 24, 288)  # 9 blocks a row: a partial round of the 4 chains
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5, 6], [0, 7, 2, 3]])
    x = torch.randn(4, 1, 288, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = ops.experts_mxfp4(x, stack, ids)
    for b in range(4):
        for c in range(4):
            assert torch.equal(got[b, c], ops.mxfp4_gemv(x[b], stack[int(ids[b, c])])[0])
    _close(got, reference.experts_mxfp4(x, stack, ids), 1e-6)


@pytest.mark.parametrize("kind", sorted(PACKED_STACKS))
def test_the_experts_operators_refuse_an_expert_outside_the_stack(ops, kind):
    prepare, inputs, block = PACKED_STACKS[kind]
    stack, x = _stack(prepare, 3, 8, inputs), torch.randn(1, 1, inputs)
    product = ops.experts_mxfp4 if kind == "mxfp4" else (lambda x, w, ids: ops.experts_fp8(x, w, ids, block))
    with pytest.raises(RuntimeError, match="expert id out of range"):
        product(x, stack, torch.tensor([[0, 3]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(PACKED_STACKS))
def test_packed_experts_is_each_experts_eager_helper_with_its_bias(machine_builds, kind, dtype):
    """moekit.ops.packed_experts (the compiled step's product) against the eager helper on each chosen
    expert: the same products in fp32, each expert's bias added in fp32, then cast."""
    prepare, inputs, block = PACKED_STACKS[kind]
    stack, bias = _stack(prepare, 4, 24, inputs), torch.randn(4, 24).to(dtype)
    ids, x = torch.tensor([[3, 1], [0, 3]]), torch.randn(2, 1, inputs).to(dtype)
    got = door.packed_experts(x, stack, ids, bias, block)
    assert got.shape == (2, 2, 24) and got.dtype == dtype
    for b in range(2):
        for c in range(2):
            e = int(ids[b, c])
            want = door.mxfp4_gemv(x[b], stack[e], bias[e]) if not block else door.fp8_gemv(x[b], stack[e], bias[e], block)
            assert torch.equal(got[b, c], want[0])


@pytest.mark.parametrize("inputs", [32, 96, 128, 2880])
def test_mxfp4_on_bf16_x_is_the_product_of_x_widened(ops, inputs):
    """A bf16 x is multiplied as it is (bf16 pairs into fp32 where the build has AVX512-BF16, else
    widened): the products of x widened to fp32, every block of gpt-oss's scale range, whole and
    partial passes of 4 blocks (1, 3, 4 and 90 blocks a row)."""
    gen = torch.Generator().manual_seed(3)
    w = packed_layout.mxfp4_prepare(torch.randn(37, inputs, generator=gen) * torch.logspace(-3, 0, inputs))
    x = torch.randn(5, inputs, generator=gen).to(torch.bfloat16)
    want = reference.mxfp4_gemv(x.float(), w)
    _close(ops.mxfp4_gemv(x, w), want, 1e-6)
    stack, ids = torch.stack([w, w.flip(0)]), torch.tensor([[1, 0], [0, 0], [1, 1], [0, 1], [1, 0]])
    got = ops.experts_mxfp4(x[:, None], stack, ids)
    for b in range(5):
        for c in range(2):
            assert torch.equal(got[b, c], ops.mxfp4_gemv(x[b : b + 1], stack[int(ids[b, c])])[0])
    _close(got, reference.experts_mxfp4(x[:, None], stack, ids), 1e-6)
