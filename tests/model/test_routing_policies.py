"""Routing policies beside the family's exact routing: where they must agree with it, and how each
renormalises (checked against hand-computed weights)."""

import pytest
import torch

from moekit.errors import MoekitError
from moekit.model.routing import (Adaptive, Exact, LayerState, PolicyRun, Reuse, Smooth, TopK, TopP,
                                  parse_policy, route, route_policy)
from moekit.spec.model_spec import RouterSpec

FAMILIES = {
    "mixtral": RouterSpec(num_experts=8, top_k=2),
    "qwen-no-norm": RouterSpec(num_experts=8, top_k=2, normalize=False),
    "gpt_oss": RouterSpec(num_experts=8, top_k=2, order="topk_then_score"),
    "deepseek_v3": RouterSpec(num_experts=8, top_k=2, scoring="sigmoid", selection_bias=True, n_group=2,
                              topk_group=1, scaling=2.5),
}


def _logits(tokens=32, experts=8, seed=0):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 2


def _bias(spec):
    return torch.linspace(-0.1, 0.1, spec.num_experts) if spec.selection_bias else None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", [Exact(), TopK(2), Adaptive(1.01), TopP(1.0)])
def test_policies_that_keep_every_expert_are_exact(family, policy):
    spec, logits = FAMILIES[family], _logits()
    want = route(logits, spec, _bias(spec))
    got = route_policy(logits, spec, _bias(spec), policy)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert torch.equal(got.topk_weights, want.topk_weights)


@pytest.mark.parametrize("family", FAMILIES)
def test_topk1_keeps_the_top_expert_at_the_familys_weight(family):
    spec, logits = FAMILIES[family], _logits()
    exact = route(logits, spec, _bias(spec))
    got = route_policy(logits, spec, _bias(spec), TopK(1))
    assert torch.equal(got.topk_ids[:, 0], exact.topk_ids[:, 0])
    if family == "qwen-no-norm":  # no renormalisation: the raw softmax score of the one kept
        want = torch.softmax(logits, dim=-1).gather(1, exact.topk_ids[:, :1])
    else:  # renormalised over one expert: weight 1 (× the routed scaling factor)
        want = torch.full((logits.shape[0], 1), spec.scaling)
    torch.testing.assert_close(got.topk_weights, want)


def test_adaptive_drops_the_second_expert_exactly_where_the_top1_share_reaches_tau():
    spec = FAMILIES["mixtral"]
    # shares of the top-1 over the top-2: token 0 ≈ 0.95, token 1 ≈ 0.5
    logits = torch.tensor([[3.0, 0.05, -9, -9, -9, -9, -9, -9], [1.0, 1.0, -9, -9, -9, -9, -9, -9]])
    got = route_policy(logits, spec, None, Adaptive(0.85))
    assert got.topk_ids[0].tolist() == [0, 0]  # one expert, padded with itself at weight 0
    assert got.topk_weights[0].tolist() == [1.0, 0.0]
    assert sorted(got.topk_ids[1].tolist()) == [0, 1]
    torch.testing.assert_close(got.topk_weights[1], torch.tensor([0.5, 0.5]))


def test_topp_keeps_the_fewest_experts_reaching_p():
    spec = RouterSpec(num_experts=8, top_k=4)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9, 1e-9, 1e-9]]))
    for p, kept in ((0.5, 1), (0.75, 2), (0.9, 3), (1.0, 4)):
        got = route_policy(logits, spec, None, TopP(p))
        assert len(set(got.topk_ids[0].tolist())) == kept, p
        assert float(got.topk_weights.sum()) == pytest.approx(1.0)


def test_ema_with_alpha_zero_is_exact_and_state_carries_across_calls():
    spec, logits = FAMILIES["mixtral"], _logits(tokens=6)
    want = route(logits, spec)
    got = route_policy(logits, spec, None, Smooth(0.0), LayerState(), rows=1)
    assert torch.equal(got.topk_ids, want.topk_ids)
    # one pass over 6 tokens equals 6 one-token passes sharing a state
    whole = route_policy(logits, spec, None, Smooth(0.9), LayerState(), rows=1)
    state = LayerState()
    steps = [route_policy(logits[t : t + 1], spec, None, Smooth(0.9), state, rows=1) for t in range(6)]
    assert torch.equal(whole.topk_ids, torch.cat([s.topk_ids for s in steps]))
    # the second token is routed on 0.9 * z0 + 0.1 * z1
    mixed = route(0.9 * logits[:1] + 0.1 * logits[1:2], spec)
    assert torch.equal(whole.topk_ids[1:2], mixed.topk_ids)


def test_reuse_takes_the_previous_experts_when_the_top1_is_unchanged():
    spec = FAMILIES["mixtral"]
    e = -9.0
    logits = torch.tensor([
        [3.0, 2.0, e, e, e, e, e, e],  # experts 0, 1
        [3.0, e, 2.0, e, e, e, e, e],  # top-1 still 0: reuses 0, 1 (weights from its own scores)
        [e, e, 3.0, 2.0, e, e, e, e],  # top-1 changed: exact 2, 3
    ])
    got = route_policy(logits, spec, None, Reuse(), LayerState(), rows=1)
    assert got.topk_ids.tolist() == [[0, 1], [0, 1], [2, 3]]
    p = torch.softmax(logits[1], dim=-1)
    torch.testing.assert_close(got.topk_weights[1], torch.stack([p[0], p[1]]) / (p[0] + p[1]))


def test_rows_keep_their_own_state():
    spec, logits = FAMILIES["mixtral"], _logits(tokens=8)
    run = PolicyRun(Reuse(), rows=2)
    both = run.at(0).route(logits, spec, None)  # 2 rows × 4 tokens
    for r in range(2):
        alone = route_policy(logits[4 * r : 4 * r + 4], spec, None, Reuse(), LayerState(), rows=1)
        assert torch.equal(both.topk_ids[4 * r : 4 * r + 4], alone.topk_ids)


@pytest.mark.parametrize("text,want", [("topk:1", TopK(1)), ("top2", TopK(2)), ("adaptive:0.85", Adaptive(0.85)),
                                       ("topp:0.9", TopP(0.9)), ("ema", Smooth(0.95)), ("ema:0.5", Smooth(0.5)),
                                       ("reuse", Reuse()), ("exact", Exact())])
def test_parse(text, want):
    assert parse_policy(text, model_k=2) == want
    assert parse_policy(str(want), model_k=2) == want


@pytest.mark.parametrize("text,says", [("adaptive:2x", "not a number"), ("topk:0", "1..2"), ("topk:9", "1..2"),
                                       ("topp:1.5", "(0, 1]"), ("greedy", "unknown routing policy"),
                                       ("adaptive:-1", "above 0"), ("topk:x", "whole number")])
def test_bad_policies_say_what_is_wrong(text, says):
    with pytest.raises(MoekitError, match=None) as err:
        parse_policy(text, model_k=2)
    assert says in str(err.value) and "\n" not in str(err.value)
