"""One `route()` reproduces every family's router in transformers: same experts, same weights.

The RouterSpec comes from the family's adapter (spec_from_config), so this also checks that the
adapter states each family's order of softmax/sigmoid, top-K, normalisation and scaling correctly.
"""

from __future__ import annotations

import pytest
import torch

from moekit.model.moe import Router
from moekit.model.routing import RoutingDecision, route
from moekit.spec import spec_from_config
from moekit.spec.model_spec import RouterSpec

transformers = pytest.importorskip("transformers")

D = 32

ROUTERS = {
    "mixtral": ("mixtral.modeling_mixtral", "MixtralTopKRouter", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter",
                  dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter",
                  dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "olmoe": ("olmoe.modeling_olmoe", "OlmoeTopKRouter", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    "granitemoe": ("granitemoe.modeling_granitemoe", "GraniteMoeTopKRouter",
                   dict(num_local_experts=6, num_experts_per_tok=2)),
    "gpt_oss": ("gpt_oss.modeling_gpt_oss", "GptOssTopKRouter", dict(num_local_experts=8, num_experts_per_tok=4)),
    "deepseek_v3": ("deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=0)),
    "deepseek_v3-unnormalized": ("deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter", dict(
        n_routed_experts=16, num_experts_per_tok=3, n_group=8, topk_group=3, routed_scaling_factor=1.5,
        norm_topk_prob=False, first_k_dense_replace=0)),
}


def _reference_and_ours(key: str, seed: int):
    import importlib

    module, cls, kwargs = ROUTERS[key]
    family = key.split("-")[0]
    config = transformers.AutoConfig.for_model(
        family, hidden_size=D, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, **kwargs
    )
    reference = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in list(reference.named_parameters()) + list(reference.named_buffers()):
            t.copy_(torch.randn(t.shape, generator=gen) * (0.3 if t.dim() == 1 else 1.0))
    spec = spec_from_config(config.to_dict(), family)
    router_spec = spec.layers[spec.moe_layers[0]].ffn.router
    ours = Router(router_spec, D)
    with torch.no_grad():
        ours.weight.copy_(reference.weight)
        if ours.bias is not None:
            ours.bias.copy_(reference.bias)
        if ours.selection_bias is not None:
            ours.selection_bias.copy_(reference.e_score_correction_bias)
    return reference, ours


def _sorted(ids: torch.Tensor, weights: torch.Tensor):
    ids, order = ids.sort(dim=-1)
    return ids, weights.float().gather(1, order)


@pytest.mark.parametrize("key", sorted(ROUTERS))
@pytest.mark.parametrize("seed", [0, 1])
def test_route_matches_transformers_router(key, seed):
    reference, ours = _reference_and_ours(key, seed)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(100 + seed))
    with torch.no_grad():
        _, want_weights, want_ids = reference(x)
    decision = ours(x)
    got_ids, got_w = _sorted(decision.topk_ids, decision.topk_weights)
    ref_ids, ref_w = _sorted(want_ids, want_weights)
    assert torch.equal(got_ids, ref_ids)
    assert (got_w - ref_w).abs().max().item() < 1e-6


def test_selection_bias_steers_choice_but_not_weights():
    spec = RouterSpec(num_experts=4, top_k=1, scoring="sigmoid", normalize=False, selection_bias=True)
    logits = torch.tensor([[2.0, 0.0, -1.0, -2.0]])
    plain = route(logits, spec, torch.zeros(4))
    steered = route(logits, spec, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert plain.topk_ids.tolist() == [[0]]
    assert steered.topk_ids.tolist() == [[3]]
    assert torch.allclose(steered.topk_weights, torch.sigmoid(torch.tensor([[-2.0]])))


def test_group_limit_masks_unchosen_groups_with_minus_infinity():
    """Negative biased scores in a kept group still beat anything in a dropped group (0.0 masking
    would let a dropped group's expert win: transformers before 5 did that)."""
    spec = RouterSpec(num_experts=4, top_k=2, scoring="sigmoid", normalize=False, n_group=2, topk_group=1,
                      selection_bias=True)
    logits = torch.tensor([[0.0, 0.0, -9.0, -9.0]])
    bias = torch.tensor([-3.0, -3.0, -3.9, 3.0])  # group 1's top-2 sum beats group 0's
    decision = route(logits, spec, bias)
    assert sorted(decision.topk_ids[0].tolist()) == [2, 3]


def test_decision_shapes_and_dtypes():
    spec = RouterSpec(num_experts=8, top_k=3)
    decision = route(torch.randn(5, 8, dtype=torch.bfloat16), spec)
    assert isinstance(decision, RoutingDecision)
    assert decision.topk_ids.shape == (5, 3) and decision.topk_ids.dtype == torch.int64
    assert decision.topk_weights.dtype == torch.float32
    assert torch.allclose(decision.topk_weights.sum(-1), torch.ones(5))
