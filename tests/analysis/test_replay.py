"""moekit.analysis.replay counts what the live store's SlotCache counts: the same hits, misses,
evictions and resident experts after every forward, for every policy, with pins and without; cache-sim's results through
it equal those through SlotCache on forwards shaped like a report's (long prefills, short steps)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.analysis.cache_sim import SIM_POLICIES, TraceCalls, simulate, simulate_reference
from moekit.analysis.replay import REPLAYED, Replay
from moekit.offload.policies import Belady, LFUAging, make_policy
from moekit.offload.slot_cache import SlotCache


def _pair(calls, slots, policy, pins=(), half_life=None):
    """(the reference SlotCache, the Replay) of one layer."""
    sequence = [e for needed in calls for e in sorted(set(needed))]
    if policy == "belady":
        chosen, future = Belady(sequence), sequence
    else:
        chosen, future = (LFUAging(half_life) if half_life else make_policy(policy)), None
    extra = {"half_life": half_life} if half_life else {}
    return SlotCache(slots, chosen, pinned=pins), Replay(slots, policy, pins, future, **extra)


def _walk(calls, slots, policy, pins=(), half_life=None):
    """The counts and resident experts of both after each forward."""
    cache, replay = _pair(calls, slots, policy, pins, half_life)
    want, got = [], []
    for needed in calls:
        cache.call(needed)
        replay.run([needed])
        want.append((cache.hits, cache.misses, cache.evictions, cache.resident))
        got.append((replay.hits, replay.misses, replay.evictions, replay.resident))
    return want, got


def test_every_policy_cache_sim_runs_is_replayed():
    assert set(REPLAYED) == set(SIM_POLICIES)


calls_strategy = st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=10), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(calls=calls_strategy, slots=st.integers(1, 12), pins=st.sets(st.integers(0, 11), max_size=3))
def test_the_replay_counts_what_slot_cache_counts_after_every_forward(calls, slots, pins):
    pins = sorted(pins)[: slots - 1]
    for policy in REPLAYED:
        want, got = _walk(calls, slots, policy, pins)
        assert got == want, policy


def test_lfu_aging_through_its_rescaling():
    # A half-life of 1 rescales the scores after 512 accesses: the replay rescales as LFUAging does.
    rng = random.Random(3)
    calls = [rng.sample(range(12), rng.randint(1, 5)) for _ in range(600)]
    want, got = _walk(calls, 4, "lfu-aging", half_life=1)
    assert sum(map(len, calls)) > 1024 and got == want


def _report_like(seed: int, experts: int = 128) -> TraceCalls:
    """Four layers of prompts back to back, each a long prefill (~100 of 128 experts) then 31
    steps of one token (K = 2), skewed as a trained router is: the forwards of `moekit report`."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** 0.8 for i in range(experts)]
    layers = (0, 1, 2, 3)
    calls = {l: [] for l in layers}
    for _ in range(6):
        for l in layers:
            order = rng.sample(range(experts), experts)
            calls[l].append(tuple(sorted(set(rng.choices(order, weights, k=256)))))
            calls[l] += [tuple(sorted(set(rng.choices(order, weights, k=2)))) for _ in range(31)]
    return TraceCalls(layers=layers, calls=calls, prefill={l: True for l in layers}, max_expert=experts - 1,
                      trace_rows=0, generated_tokens=0, decode_tokens=0)


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_cache_sim_through_the_replay_equals_it_through_slot_cache(policy):
    trace = _report_like(seed=len(policy))
    for slots in (1, 3, 16, 64, 100, 128):
        pins = {0: [5, 9, 77][: slots // 2], 2: [1][: slots // 2]}
        assert simulate(trace, policy, slots, pins) == simulate_reference(trace, policy, slots, pins), slots


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="lru"):
        Replay(4, "fifo")
    with pytest.raises(ValueError, match="sequence"):
        Replay(4, "belady")
    with pytest.raises(ValueError, match="1 slot"):
        Replay(0, "lru")
    with pytest.raises(ValueError, match="pinned"):
        Replay(2, "lru", pinned=[1, 2])
    replay = Replay(2, "belady", future=[0, 1])
    replay.run([[0]])
    with pytest.raises(ValueError, match="says otherwise"):
        replay.run([[5]])
