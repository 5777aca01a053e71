"""The slot cache keeps its promises under any sequence of forwards and prefetches: at most `slots`
resident, pins never evicted, a forward never evicts an expert it is about to use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.offload.policies import LIVE_POLICIES, make_policy
from moekit.offload.slot_cache import SlotCache, most_pins

E = 16
needed_sets = st.sets(st.integers(0, E - 1), min_size=1, max_size=E)
# A forward's needed experts, or a prefetch of a predicted set.
events = st.lists(st.tuples(st.sampled_from(["call", "admit"]), needed_sets), min_size=1, max_size=40)


@settings(max_examples=120, deadline=None)
@given(events=events, slots=st.integers(1, E), pins=st.sets(st.integers(0, E - 1), max_size=6),
       name=st.sampled_from(LIVE_POLICIES))
def test_pins_stay_and_residency_never_exceeds_the_slots(events, slots, pins, name):
    pins = set(sorted(pins)[: slots - 1])
    cache = SlotCache(slots, make_policy(name), pinned=pins)
    for kind, experts in events:
        if kind == "call":
            for access in cache.call(experts):
                assert access.evicted not in pins
        else:
            for e in sorted(experts):
                assert cache.admit(e, protect=experts) not in pins
        assert pins <= cache.resident
        assert len(cache.resident) <= slots


@settings(max_examples=120, deadline=None)
@given(calls=st.lists(needed_sets, min_size=1, max_size=40), slots=st.integers(1, E),
       name=st.sampled_from(LIVE_POLICIES))
def test_a_forward_never_evicts_what_it_needs_when_it_fits(calls, slots, name):
    cache = SlotCache(slots, make_policy(name))
    accesses = 0
    for needed in calls:
        got = cache.call(needed)
        accesses += len(needed)
        if len(needed) <= slots:
            assert needed <= cache.resident
            assert not {a.evicted for a in got} & needed
        assert len(got) == len(needed)
    assert cache.hits + cache.misses == cache.accesses == accesses


def test_a_prefill_wider_than_the_cache_evicts_what_it_has_finished_with():
    cache = SlotCache(3, make_policy("lru"))
    got = cache.call([7, 1, 5, 3, 9])  # processed 1, 3, 5, 7, 9
    assert [a.hit for a in got] == [False] * 5
    assert [a.evicted for a in got] == [None, None, None, 1, 3]
    assert cache.resident == {5, 7, 9}


def test_with_every_expert_fitting_only_first_uses_miss():
    cache = SlotCache(E, make_policy("lfu"))
    calls = [{1, 2}, {2, 3}, {1, 9}, {3, 9, 2}, {15}]
    for needed in calls:
        cache.call(needed)
    assert cache.misses == len(set().union(*calls)) and cache.evictions == 0


def test_a_prefetch_counts_no_hit_or_miss_and_respects_protection():
    cache = SlotCache(2, make_policy("lru"))
    cache.call([0, 1])
    assert cache.admit(0) is None and cache.hits + cache.misses == 2  # already resident: nothing
    assert cache.admit(4, protect={0, 1}) is None and 4 not in cache  # no unprotected room
    assert cache.admit(4, protect={1}) == 0 and 4 in cache
    assert (cache.hits, cache.misses, cache.evictions, cache.prefetched) == (0, 2, 1, 1)
    assert cache.call([4])[0].hit  # the prefetch pays off as a hit


def test_pins_start_resident_and_hit():
    cache = SlotCache(4, make_policy("lru"), pinned=[3, 8])
    assert cache.resident == cache.pinned == {3, 8}
    assert {e: a.hit for e, a in cache.forward([8, 5, 3])} == {3: True, 5: False, 8: True}


def test_a_failed_load_is_forgotten_without_counting_an_eviction():
    cache = SlotCache(3, make_policy("lru"), pinned=[2])
    cache.call([5])
    cache.discard(5)
    cache.discard(2)
    assert cache.resident == set() and cache.pinned == set() and cache.evictions == 0
    assert not cache.call([5])[0].hit


def test_impossible_caches_are_refused():
    with pytest.raises(ValueError):
        SlotCache(0, make_policy("lru"))
    with pytest.raises(ValueError):
        SlotCache(3, make_policy("lru"), pinned=[0, 1, 2])  # no slot left for anything else


def test_pins_take_at_most_half_the_slots():
    assert [most_pins(s) for s in (1, 2, 3, 8)] == [0, 1, 1, 4]


@settings(max_examples=80, deadline=None)
@given(calls=st.lists(needed_sets, min_size=1, max_size=30), slots=st.integers(1, E),
       name=st.sampled_from(LIVE_POLICIES))
def test_the_live_walk_and_the_simulated_one_are_the_same(calls, slots, name):
    live, simulated = SlotCache(slots, make_policy(name)), SlotCache(slots, make_policy(name))
    for needed in calls:
        walked = list(live.forward(needed))
        assert [e for e, _ in walked] == sorted(needed)
        assert [a for _, a in walked] == simulated.call(needed)
    assert live.resident == simulated.resident
