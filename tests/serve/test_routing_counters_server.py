"""A real `moekit serve`: routing policies' load-control counters on /metrics, and topk:k above K.

Oracles: the scheduler run in this process on the same requests (n identical greedy continuations
admitted together, so they decode in one batch and their routing collides) — the served counters
are its PolicyStats, per policy and layer; and `generate(..., policy=topk:E)` of the Python API
(dense routing) for a served request that asks for all E experts.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.model.routing import parse_policy
from moekit.serve.metrics import POLICY_COUNTERS

PROMPT = [1, 17, 42, 99, 5, 63, 120, 7]
NEW = 6
CAPACITY = "capacity:1:drop"

pytestmark = pytest.mark.processes


def counters(url: str) -> dict:
    """(field, policy, layer) → value of the routing policy counters on /metrics."""
    names = {name + "_total": field for field, (name, _) in POLICY_COUNTERS.items()}
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in names:
                out[(names[sample.name], sample.labels["policy"], int(sample.labels["layer"]))] = sample.value
    return out


def complete(url: str, routing: str, n: int = 1) -> dict:
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "n": n,
            "moe": {"routing": routing}}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120.0)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_capacity_overflow_counters_rise_by_what_the_policy_counted(server, engine):
    assert not [key for key in counters(server.url) if key[1] == CAPACITY]  # nothing routed by it yet
    served = complete(server.url, CAPACITY, n=4)  # four identical rows: each step's experts collide

    policy = parse_policy(CAPACITY, 2, 128)
    scheduler = Scheduler(engine.decoder, max_batch=16)
    here = generate_batch(scheduler, [Request(prompt=PROMPT, max_new_tokens=NEW, routing=policy) for _ in range(4)])
    assert [c["token_ids"] for c in served["choices"]] == [o.token_ids for o in here]

    seen = counters(server.url)
    ledger = scheduler.policy_stats[CAPACITY]
    assert sum(stats.overflow for stats in ledger.values()) > 0  # the policy had to overflow
    for layer, stats in ledger.items():
        for field in POLICY_COUNTERS:
            assert seen[(field, CAPACITY, layer)] == getattr(stats, field), (field, layer)
        assert stats.dropped == stats.overflow and stats.routed > 0


def test_a_request_may_route_to_all_experts_and_gets_dense_routings_tokens(server, engine):
    served = complete(server.url, "topk:128")
    dense = engine.generate([PROMPT], max_new_tokens=NEW, stop_ids=(), policy=parse_policy("topk:128", 2, 128))
    assert served["choices"][0]["token_ids"] == dense.token_ids[0]
    assert served["usage"]["moe"]["top_k"] == 128


def test_topk_above_e_is_a_400_naming_the_range(server):
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "moe": {"routing": "topk:129"}},
                       timeout=60.0)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "moe.routing" and "1..128" in error["message"]
