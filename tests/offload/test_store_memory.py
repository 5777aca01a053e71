"""What the expert store holds stays within --expert-memory under any routing, and paging changes no token.

The store's own accounting (moekit.offload.store.StoreClock): resident experts, plus the evicted
experts a forward still runs. Routing as the 30B benchmark varies it (benchmarks/real_scale.py): the
family's own (a random model's tokens route nearly alike), per-token noise (moekit's gumbel policy:
each token's experts drawn on their own), and noise on skewed routers (a Zipf-like bias,
benchmarks/skewed_routing.py). The 7-id prompt needs more experts than the 25% budget's 2 slots.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hf_tiny import write_checkpoint
from moekit.engine.loader import load_engine
from moekit.model.routing import parse_policy
from moekit.offload.options import OffloadOptions
from offload_files import PROMPTS

ROOT = Path(__file__).resolve().parents[2]
NEW = 16


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=1)


def _skew_routers():
    spec = importlib.util.spec_from_file_location("skewed_routing", ROOT / "benchmarks" / "skewed_routing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.skew_routers


def _run(folder, routing: str, offload=None):
    """(each prompt's greedy ids, the store's stats or None, one expert's bytes or None)."""
    engine = load_engine(folder, offload=offload, compile=False)
    try:
        if routing == "skewed":
            _skew_routers()(engine.decoder, 1.0)
        router = engine.spec.layers[engine.spec.moe_layers[0]].ffn.router
        ids = []
        for p in PROMPTS:
            policy = None if routing == "family" else parse_policy("gumbel:1:0", router.top_k, router.num_experts)
            ids.append(engine.generate(p, max_new_tokens=NEW, stop_ids=(), policy=policy).token_ids[0])
        store = engine.store
        return ids, store.stats() if store else None, store.expert_bytes if store else None
    finally:
        engine.close()


@pytest.mark.parametrize("routing", ["family", "noisy", "skewed"])
@pytest.mark.parametrize("budget", ["25%", "60%"])
def test_the_store_holds_no_more_than_its_budget_and_pages_the_resident_tokens(qwen, routing, budget):
    want, _, _ = _run(qwen, routing)
    got, stats, _ = _run(qwen, routing, OffloadOptions(budget, read_ahead=0))
    assert got == want
    assert stats["loads"] > 0 and stats["hit_rate"] < 1
    # Read one at a time, an expert runs before the next access may evict it: nothing is kept.
    assert 0 < stats["peak_resident_expert_bytes"] == stats["peak_held_expert_bytes"] <= stats["expert_memory_bytes"]


@pytest.mark.parametrize("routing", ["family", "noisy"])
def test_a_prompt_read_ahead_past_the_slots_keeps_at_most_the_read_ahead_beyond_the_budget(qwen, routing):
    """At 2 slots a 7-id prompt's experts outnumber the slots; reading 3 ahead, the walk evicts
    experts it has read but not run. Their weights live until the forward ends, counted as held:
    at most read_ahead + 1 experts past the budget, and the tokens stay the resident ones."""
    want, _, _ = _run(qwen, routing)
    got, stats, expert = _run(qwen, routing, OffloadOptions("25%", read_ahead=3))
    assert got == want and stats["slots_per_layer"] == 2
    assert stats["peak_resident_expert_bytes"] <= stats["expert_memory_bytes"]
    assert stats["peak_resident_expert_bytes"] < stats["peak_held_expert_bytes"]
    assert stats["peak_held_expert_bytes"] <= stats["expert_memory_bytes"] + 4 * expert
