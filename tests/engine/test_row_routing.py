"""Rows of one running batch routed by their own requests' policies (engine/row_routing.py).

The oracles: a row without a policy gets its lone greedy tokens (moekit's own `generate`, itself
held to transformers'), and a row with policy P gets what `generate(..., policy=P)` — the path of
`moekit run --routing P` — gives it alone, while rows of other policies join and leave beside it.
"""

from __future__ import annotations

import pytest

from moekit.engine.loader import load_engine
from moekit.engine.meter import params_per_token
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.model.routing import parse_policy

PROMPTS = [[1, 17, 42, 99, 5, 63, 120], [3, 4], [7, 8, 9, 10, 11, 12, 13, 14], [150, 2, 77], [5, 6, 7, 8, 9]]
NEW = [9, 6, 11, 7, 8]
POLICIES = [None, "adaptive:0.6", "ema:0.9", "reuse", "topk:1"]


def lone(engine, prompt, new, policy=None):
    return engine.generate([prompt], max_new_tokens=new, stop_ids=(), policy=policy).token_ids[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_each_row_gets_what_its_policy_gives_it_alone(family, tiny_checkpoints):
    engine = load_engine(tiny_checkpoints(family), compile=False)
    k = max(params_per_token(engine.spec).top_k.values())
    policies = [None if p is None else parse_policy(p, k) for p in POLICIES]
    scheduler = Scheduler(engine.decoder, max_batch=3)  # five requests, three rows: rows join mid-run
    requests = [Request(prompt=p, max_new_tokens=n, routing=pol) for p, n, pol in zip(PROMPTS, NEW, policies)]
    outcomes = generate_batch(scheduler, requests)
    for prompt, new, policy, outcome in zip(PROMPTS, NEW, policies, outcomes):
        assert outcome.token_ids == lone(engine, prompt, new, policy), f"{family}: {policy}"
        assert outcome.usage.routing == (None if policy is None else str(policy))


def test_a_free_row_beside_policy_rows_in_one_prefill_keeps_its_tokens(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    top1 = parse_policy("top1", 2)
    scheduler = Scheduler(engine.decoder, max_batch=4)
    requests = [Request(prompt=PROMPTS[0], max_new_tokens=8), Request(prompt=PROMPTS[1], max_new_tokens=8, routing=top1),
                Request(prompt=PROMPTS[2], max_new_tokens=8), Request(prompt=PROMPTS[3], max_new_tokens=8, routing=top1)]
    outcomes = generate_batch(scheduler, requests)  # all four admitted in one step
    assert outcomes[0].token_ids == lone(engine, PROMPTS[0], 8)
    assert outcomes[2].token_ids == lone(engine, PROMPTS[2], 8)
    assert outcomes[1].token_ids == lone(engine, PROMPTS[1], 8, top1)


def test_usage_work_is_the_hand_count_of_expert_and_dense_weights(tiny_checkpoints):
    """top1: every pass uses exactly one expert per MoE layer, so the FLOPs are countable by hand."""
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    counts = params_per_token(engine.spec)
    prompt, new = PROMPTS[0], 6
    (outcome,) = generate_batch(Scheduler(engine.decoder), [Request(prompt=prompt, max_new_tokens=new,
                                                                    routing=parse_policy("top1", 2))])
    passes = len(prompt) + new - 1  # the prompt's tokens, then one pass per generated token but the last
    expert_params = sum(counts.expert_each.values())  # one expert in each MoE layer
    head = counts.head or counts.embedding_table
    work = outcome.usage.work
    assert work.expert_flops == 2 * expert_params * passes
    assert work.expert_bytes == 4 * expert_params * passes  # fp32
    assert work.flops == work.expert_flops + 2 * counts.fixed * passes + 2 * head * new
    assert outcome.usage.as_dict()["expert_flops"] == work.expert_flops
