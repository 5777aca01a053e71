"""The many-token forward over resident Hub-layout stacks (two grouped GEMMs, a prompt's path on a
compiled engine) equals the per-expert loop bit for bit, in fp32 and bf16, and the obvious sum."""

from __future__ import annotations

import pytest
import torch

from moekit.model.experts import RoutedExperts, experts_reference
from moekit.model.mlp import Activation
from moekit.model.routing import RoutingDecision
from moekit.spec.model_spec import MLPSpec

E, D, F = 8, 32, 24


def _experts(dtype: torch.dtype, seed: int, width: int = F) -> RoutedExperts:
    gen = torch.Generator().manual_seed(seed)
    ex = RoutedExperts(MLPSpec(hidden_size=D, width=width, gated=True, bias=False, activation="silu"), E,
                       Activation(kind="silu", limit=1.0))
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ex.to(dtype).prepare(kernels=False)
    return ex


def _decision(tokens: int, k: int, seed: int, pad_first: bool = False) -> RoutingDecision:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
    if pad_first:  # route_rows' narrower row: its first expert repeated at weight 0
        ids[0, 1:] = ids[0, 0]
        weights[0, 1:] = 0
    return RoutingDecision(topk_ids=ids, topk_weights=weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k", [(2, 2), (9, 3), (64, 4)])
def test_grouped_stacks_equal_the_per_expert_loop_bit_for_bit(dtype, tokens, k):
    ex = _experts(dtype, seed=tokens + k)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(k)).to(dtype)
    decision = _decision(tokens, k, seed=tokens * k, pad_first=True)
    assert ex._stacks_grouped(x)
    with torch.inference_mode():
        fast = ex(x, decision)
        loop = ex._grouped_loop(x, decision, ex.resident_weights)
        reference = experts_reference(ex, x, decision)
    assert torch.equal(fast, loop)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fast.float(), reference.float(), atol=tol, rtol=tol)


def test_other_layouts_keep_the_loop():
    ex = _experts(torch.float32, seed=1)
    assert not ex._stacks_grouped(torch.zeros(2, D, dtype=torch.float16))
    ex.weigh_input = True  # llama4 scales each expert's input: the loop does that
    assert not ex._stacks_grouped(torch.zeros(2, D))


def test_rows_torchs_grouped_gemm_refuses_run_the_loop():
    """The bundled model's width, 52, is 104 bytes a row in bf16, which torch's grouped GEMM refuses
    (it wants multiples of 16 bytes): a prompt over Hub-layout stacks (a compiled engine's prefill)
    takes the per-expert loop there, and the grouped GEMMs in fp32 (208 bytes)."""
    ex = _experts(torch.bfloat16, seed=3, width=52)
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    decision = _decision(9, 2, seed=5)
    assert not ex._stacks_grouped(x)
    with torch.inference_mode():
        out, reference = ex(x, decision), experts_reference(ex, x, decision)
    torch.testing.assert_close(out.float(), reference.float(), atol=3e-2, rtol=3e-2)
    assert _experts(torch.float32, seed=3, width=52)._stacks_grouped(x.float())
