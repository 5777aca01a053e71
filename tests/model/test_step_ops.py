"""The decode step's eager forms in moekit.model.step_ops against what they stand for: `einsum` is
torch.einsum to the bit (the same bmm, fewer ops), `write_slots` writes each row's token where the
per-row loop would, and `attend` is the masked softmax attention it replaces."""

from __future__ import annotations

import pytest
import torch

from moekit.model import step_ops

# The step's products (attention, MLA's absorbed projections) and one with no single-matmul form.
EQUATIONS = [("bkgd,bksd->bkgs", (3, 4, 2, 16), (3, 4, 9, 16)), ("bkgs,bksd->bkgd", (3, 4, 2, 9), (3, 4, 9, 16)),
             ("bhn,hnr->bhr", (1, 8, 16), (8, 16, 32)), ("bhc,bsc->bhs", (2, 3, 40), (2, 7, 40)),
             ("bhs,bsr->bhr", (2, 3, 7), (2, 7, 32)), ("bhr,hrv->bhv", (3, 8, 32), (8, 32, 16)), ("ij,jk->ki", (3, 5), (5, 4)),
             ("bij,jk->bk", (2, 3, 5), (5, 4))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("equation, left, right", EQUATIONS)
def test_einsum_is_torch_einsum_to_the_bit(equation, left, right, dtype):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(left, generator=gen).to(dtype), torch.randn(right, generator=gen).to(dtype)
    assert torch.equal(step_ops.einsum(equation, a, b), torch.einsum(equation, a, b))


def test_only_single_matmul_equations_get_a_plan():
    assert step_ops._matmul_plan("bhn,hnr->bhr") is not None
    assert step_ops._matmul_plan("bij,jk->bk") is None  # i summed on one side only
    assert step_ops._matmul_plan("ii,ij->j") is None  # a repeated letter


@pytest.mark.parametrize("shape", [(5, 3, 2, 10, 8), (4, 3, 10, 12)], ids=["per-head k/v", "mla slots"])
def test_write_slots_puts_each_rows_token_at_its_slot(shape):
    stack = torch.zeros(shape)
    slot = torch.tensor([4, 7])
    values = torch.randn((2,) + shape[2:-2] + shape[-1:])  # [B, .., W]
    want = stack.clone()
    for r in range(2):
        want[1, r, ..., slot[r], :] = values[r]
    step_ops.write_slots(stack, 1, slot, values)
    assert torch.equal(stack, want)


def test_attend_is_the_masked_softmax_attention():
    gen = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(shape, generator=gen) for shape in ((2, 2, 3, 8), (2, 2, 6, 8), (2, 2, 6, 8)))
    allowed = torch.tensor([[True] * 6, [False, False, True, True, True, False]])  # row 1: padding, then a later slot
    logits = (q @ keys.transpose(-1, -2)) * 0.3
    want = torch.softmax(logits.masked_fill(~allowed[:, None, None, :], float("-inf")), dim=-1) @ values
    torch.testing.assert_close(step_ops.attend(q, keys, values, allowed, 0.3), want, rtol=1e-5, atol=1e-6)
