"""Routing policies inside the decode step (moekit.model.seated_policy): every policy's steps, eager
and compiled, against the modules' forward (Decoder.forward_modules), which routed policies before:
the same greedy fp32 tokens, the same experts (weights within float rounding: the step computes the
router's input with its own products), the same policy counters. Two rows, one left-padded, so the
batch-level policies (capacity, loadaware) see a batch."""

from __future__ import annotations

import functools

import pytest
import torch

from moekit.model.routing import PolicyRun, parse_policy
from moekit.model.seated_policy import narrowed, padded
from moekit.model.routing import RoutingDecision
from tests.model.engine_pairs import eager_and_compiled

PROMPTS = ([5, 9, 33, 7, 81, 14, 3, 60], [12, 40, 41])  # row 1 left-padded by 5
STEPS = 6
# One of each kind; topk:3 and split:3 route wider than the tiny models' K = 2.
POLICIES = ("exact", "topk:1", "topk:3", "adaptive:0.6", "topp:0.7", "ema:0.9", "reuse", "temp:0.7", "gumbel:0.5:3",
            "minconf:0.3", "split:3:0.9", "cache:8:1", "loadaware:0.8", "capacity:1:drop", "capacity:1:reroute",
            "ema:0.9+reset:2")


@pytest.fixture(scope="module")
def decoders(tiny_checkpoints):
    """family → (eager decoder, compiled decoder) of the same checkpoint."""

    def get(family: str):
        eager, compiled = eager_and_compiled(tiny_checkpoints(family))
        return eager.decoder, compiled.decoder

    return functools.cache(get)


def _greedy(decoder, policy: str, through) -> tuple[list, list, object]:
    """Prefill PROMPTS under `policy` (the modules' forward), then STEPS greedy decode steps through
    `through(decoder)` (a Decoder method) → (tokens per step, decisions per step, the run's counters)."""
    cache = decoder.new_cache(2, 24)
    cache.key_mask[1, :5] = False
    run = PolicyRun(parse_policy(policy, 2, 8), rows=2)
    with torch.inference_mode():
        logits = decoder(torch.tensor([PROMPTS[0], [0] * 5 + PROMPTS[1]]), cache,
                         torch.tensor([list(range(8)), [0] * 5 + [0, 1, 2]]), policy=run)
        token, positions, tokens, decisions = logits[:, -1].argmax(-1), torch.tensor([8, 3]), [], []
        for s in range(STEPS):
            made: list = []
            logits = through(decoder)(token[:, None], cache, (positions + s)[:, None], decisions=made, policy=run)
            token = logits[:, -1].argmax(-1)
            tokens.append(token.tolist())
            decisions.append(made)
    return tokens, decisions, run.stats


def _same_decisions(reference: list, step: list, rtol: float) -> None:
    """Each layer's experts equal; the step's decision, padded to its width, adds only zero weights."""
    for want_step, got_step in zip(reference, step, strict=True):
        for (layer, want), (got_layer, got) in zip(want_step, got_step, strict=True):
            k = want.topk_ids.shape[1]
            assert layer == got_layer
            assert torch.equal(got.topk_ids[:, :k], want.topk_ids)
            torch.testing.assert_close(got.topk_weights[:, :k], want.topk_weights, rtol=rtol, atol=rtol / 10)
            assert not got.topk_weights[:, k:].any()


@pytest.mark.parametrize("policy", POLICIES)
def test_the_eager_step_routes_each_policy_as_the_forward(decoders, policy):
    eager, _ = decoders("qwen3_moe")
    want = _greedy(eager, policy, lambda d: d.forward_modules)
    got = _greedy(eager, policy, lambda d: d.forward)  # T = 1: decode_step, eagerly
    assert got[0] == want[0]
    _same_decisions(want[1], got[1], rtol=1e-5)
    assert got[2] == want[2]  # routed, cache hits, overflow, drops, reroutes: the policy ran the same


def test_the_compiled_step_routes_each_policy_as_the_forward(decoders):
    """All policies on one compiled decoder: a graph per decision width (1, 2 and 3 here), whichever
    policy is seated; the policy runs in the graph as one opaque op per MoE layer. DeepSeek-V3's
    routing (selection bias, group limit widened past K) is the hardest to hold to; the graphs'
    compiles are the cost of this test, so one family."""
    eager, compiled = decoders("deepseek_v3")
    for policy in POLICIES:
        want = _greedy(eager, policy, lambda d: d.forward_modules)
        got = _greedy(compiled, policy, lambda d: d.forward)
        assert got[0] == want[0], policy
        _same_decisions(want[1], got[1], rtol=1e-4)
        assert got[2] == want[2], policy
    step = compiled.compiled
    assert step.direct_steps > 0
    assert {routing.width for routing in step._graphs if routing.seated} == {1, 2, 3}


def test_padding_and_narrowing_give_back_the_policys_decision():
    decision = RoutingDecision(torch.tensor([[3, 1], [4, 4]]), torch.tensor([[0.75, 0.25], [1.0, 0.0]]))
    ids, weights = padded(decision, 3)
    assert ids.tolist() == [[3, 1, 3], [4, 4, 4]] and weights.tolist() == [[0.75, 0.25, 0.0], [1.0, 0.0, 0.0]]
    back = narrowed(RoutingDecision(ids, weights))
    assert torch.equal(back.topk_ids, decision.topk_ids) and torch.equal(back.topk_weights, decision.topk_weights)
    one = narrowed(RoutingDecision(*padded(RoutingDecision(torch.tensor([[2], [5]]), torch.ones(2, 1)), 2)))
    assert one.topk_ids.tolist() == [[2], [5]]
    with pytest.raises(RuntimeError, match="more than the step's width 1"):
        padded(decision, 1)
