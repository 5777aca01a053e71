"""Batch-level routing policies in the scheduler (engine/row_routing.py, scheduler._run_for).

capacity and loadaware decide a token by the load of its whole step, so the scheduler routes the
rows of one decode step that share such a policy as one batch. Oracles: the capacity bound itself
(no expert gets more than max(1, ceil(f·B·K/E)) kept assignments of the B rows sharing the policy,
counted from the decisions the decoder returned), a free row beside them keeps its lone tokens, a
lone request equals `generate(..., policy=P)`, and the server-wide ledger adds up what each step
dropped.
"""

from __future__ import annotations

from collections import Counter

from moekit.engine.loader import load_engine
from moekit.engine.row_routing import RowRouting
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.model.routing import parse_policy
from moekit.model.routing_policies import capacity_of

PROMPTS = [[1, 17, 42, 99, 5], [3, 4, 9], [7, 8, 9, 10, 11, 12], [150, 2, 77], [5, 6, 7, 8], [1, 17, 42, 99, 5]]
NEW = 8


def lone(engine, prompt, policy=None):
    return engine.generate([prompt], max_new_tokens=NEW, stop_ids=(), policy=policy).token_ids[0]


def recorded_steps(decoder) -> list:
    """Wrap the decoder's batched step so each call's (policy, decisions) is kept; it still runs.
    The step's form hands its routing back whole (StepChoices) where the scheduler asks for that."""
    steps, forward = [], decoder.forward_rows

    def forward_rows(ids, cache, lengths, decisions=None, top_k=None, policy=None, choices=None, **more):
        out = forward(ids, cache, lengths, decisions, top_k, policy, choices, **more)
        steps.append((policy, choices[-1].decisions() if choices else list(decisions or [])))
        return out

    decoder.forward_rows = forward_rows
    return steps


def test_rows_sharing_a_capacity_policy_never_overload_an_expert_and_free_rows_keep_their_tokens(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    policy = parse_policy("capacity:0.5:drop", 2, 8)
    scheduler = Scheduler(engine.decoder, max_batch=8)
    steps = recorded_steps(engine.decoder)
    routings = [policy, policy, None, policy, policy, policy]  # the last repeats the first prompt: they collide
    requests = [Request(prompt=p, max_new_tokens=NEW, routing=r) for p, r in zip(PROMPTS, routings)]
    outcomes = generate_batch(scheduler, requests)

    shared, checked = None, 0
    for routing, decisions in steps:
        assert isinstance(routing, RowRouting)
        runs = [run for run in routing.runs if run is not None]
        assert all(run is runs[0] for run in runs)  # one run for every row of the policy
        shared = runs[0]
        members = [r for r, run in enumerate(routing.runs) if run is not None]
        cap = capacity_of(0.5, len(members), 2, 8)
        for _, decision in decisions:
            kept = Counter(int(e) for r in members for e, w in zip(decision.topk_ids[r].tolist(), decision.topk_weights[r].tolist()) if w > 0)
            assert max(kept.values()) <= cap, (len(members), kept)
            checked += len(members) > 1
    assert checked > 0
    stats = scheduler.policy_stats[str(policy)]
    assert shared.stats.dropped == sum(s.dropped for s in stats.values()) > 0  # it had to drop to keep the bound
    assert shared.stats.overflow == shared.stats.dropped and shared.stats.rerouted == 0
    assert outcomes[2].token_ids == lone(engine, PROMPTS[2])


def test_a_lone_batch_level_request_equals_the_solo_run(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    for text in ("capacity:0.5:reroute", "loadaware:0.8:0.5"):
        policy = parse_policy(text, 2, 8)
        for prompt in PROMPTS[:2]:  # one after another: the second starts a fresh shared run
            (outcome,) = generate_batch(Scheduler(engine.decoder), [Request(prompt=prompt, max_new_tokens=NEW, routing=policy)])
            assert outcome.token_ids == lone(engine, prompt, policy), text


def test_topk_wider_than_the_models_k_in_the_scheduler_equals_the_engines(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    dense = parse_policy("topk:8", 2, 8)
    scheduler = Scheduler(engine.decoder, max_batch=4)
    requests = [Request(prompt=PROMPTS[0], max_new_tokens=NEW, routing=dense), Request(prompt=PROMPTS[1], max_new_tokens=NEW)]
    wide, free = generate_batch(scheduler, requests)
    assert wide.token_ids == lone(engine, PROMPTS[0], dense)
    assert free.token_ids == lone(engine, PROMPTS[1])
    assert wide.usage.top_k == 8 and wide.usage.active_params_per_token > free.usage.active_params_per_token
