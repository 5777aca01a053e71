"""The fast expert paths (one token: its K experts; many: grouped by expert) equal the obvious loop."""

from __future__ import annotations

import pytest
import torch

from moekit.model.experts import RoutedExperts, experts_reference
from moekit.model.linear import ONEDNN, PLAIN, ROWS, TRANSPOSED
from moekit.model.mlp import Activation
from moekit.model.routing import RoutingDecision
from moekit.spec.model_spec import MLPSpec
from moekit.ops.torch_private import onednn_bf16_supported

E, D, F = 6, 16, 12


def _experts(kind: str, bias: bool, seed: int, d: int = D, f: int = F) -> RoutedExperts:
    gen = torch.Generator().manual_seed(seed)
    spec = MLPSpec(hidden_size=d, width=f, gated=True, bias=bias, activation=kind)
    ex = RoutedExperts(spec, E, Activation(kind=kind, limit=1.0))
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return ex


def _decision(tokens: int, k: int, seed: int) -> RoutingDecision:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    return RoutingDecision(topk_ids=ids, topk_weights=weights)


@pytest.mark.parametrize("kind,bias", [("silu", False), ("swiglu_oai", True), ("gelu_tanh", False)])
@pytest.mark.parametrize("tokens,k", [(1, 2), (1, 4), (9, 2), (30, 3)])
def test_fast_path_equals_reference(kind, bias, tokens, k):
    ex = _experts(kind, bias, seed=tokens * 10 + k)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(k))
    decision = _decision(tokens, k, seed=tokens + k)
    want = experts_reference(ex, x, decision)
    got = ex(x, decision)
    assert want.abs().max() > 0.1  # the experts do something at this scale
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k", [(1, 3), (9, 2)])
def test_prepared_experts_equal_the_reference(dtype, tokens, k):
    """Per-expert fast layouts (transposed fp32, oneDNN-packed bf16) against the plain loop before them."""
    ex = _experts("swiglu_oai", True, seed=7).to(dtype)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(8)).to(dtype)
    decision = _decision(tokens, k, seed=9)
    want = experts_reference(ex, x, decision).float()
    ex.prepare()
    fast = TRANSPOSED if dtype == torch.float32 else ONEDNN
    if fast is ONEDNN and not onednn_bf16_supported():
        fast = PLAIN
    assert ex.kernels == (fast, fast)  # fp32: out >= in for both [2F, D] and [D, F] at this size
    if fast is not PLAIN:
        assert len(list(ex.parameters())) == 2 * E + 2  # one weight per expert and matrix, plus 2 bias stacks
    got = ex(x, decision).float()
    # bf16: the reference loop adds each token's K outputs in another order than the fast paths
    tol = 1e-5 if dtype == torch.float32 else 0.02 * want.abs().max().item()
    assert (got - want).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,bias,weigh_input", [("silu", False, False), ("swiglu_oai", True, False), ("gelu_tanh", False, False),
                                                   ("silu", False, True)], ids=["silu", "swiglu_oai-bias", "gelu_tanh", "llama4-weigh-input"])
@pytest.mark.parametrize("tokens,k", [(1, 3), (5, 2), (16, 3)])
@pytest.mark.parametrize("d,f", [(D, F), (96, 40)], ids=["narrow", "vector-tails"])
def test_the_row_operators_decode_is_the_combine_bit_for_bit(dtype, kind, bias, weigh_input, tokens, k, d, f):
    """Experts prepared for a command that loaded the operators keep their stacks (ROWS); the decode
    step (at batch 1 moekit::experts_gemv on the stacks in place, else the combine) gives the
    combine's floats bit for bit (the modules' forward's, the expert-parallel layer's: each expert
    through rows_gemv), activations with vector tails included."""
    from moekit import ops

    assert ops.load().ok, ops.load().failures()  # as a command with --kernels auto loads them
    ex = _experts(kind, bias, seed=tokens + k, d=d, f=f).to(dtype)
    ex.weigh_input = weigh_input
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(k)).to(dtype)
    decision = _decision(tokens, k, seed=tokens * k)
    want = experts_reference(ex, x, decision).float()
    ex.prepare(operators=True)
    assert ex.kernels == (ROWS, ROWS) and ex.gate_up.shape == (E, 2 * f, d)  # the stacks, kept
    combined = ex(x, decision)
    assert torch.equal(ex.decode(x, decision), combined)
    tol = (1e-6 if dtype == torch.float32 else 0.02) * want.abs().max().item()
    assert (combined.float() - want).abs().max().item() < tol


def test_unchosen_experts_do_not_matter():
    ex = _experts("silu", False, seed=3)
    x = torch.randn(5, D)
    decision = RoutingDecision(topk_ids=torch.tensor([[0, 1]] * 5), topk_weights=torch.full((5, 2), 0.5))
    before = ex(x, decision)
    with torch.no_grad():
        ex.gate_up[2:].fill_(float("nan"))
    assert torch.equal(ex(x, decision), before)


def test_swiglu_oai_clamps_gate_and_up():
    act = Activation(kind="swiglu_oai", limit=7.0)
    gate = torch.tensor([100.0, -3.0])
    up = torch.tensor([-100.0, 2.0])
    out = act(torch.cat([gate, up]))
    want_0 = (-7.0 + 1) * 7.0 * torch.sigmoid(torch.tensor(7.0 * 1.702))
    want_1 = (2.0 + 1) * -3.0 * torch.sigmoid(torch.tensor(-3.0 * 1.702))
    assert torch.allclose(out, torch.stack([want_0, want_1]))
