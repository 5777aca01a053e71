"""Eviction policies choose the victims their definitions say, and Belady's MIN bounds them all."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.errors import MoekitError
from moekit.offload.policies import HALF_LIFE, LFRU, LFU, LIVE_POLICIES, LRU, POLICIES, Belady, LFUAging, make_policy
from moekit.offload.slot_cache import SlotCache


def _replay(cache: SlotCache, accesses) -> list:
    return [cache.access(e) for e in accesses]


def test_lru_and_lfu_differ_on_a_frequent_but_older_expert():
    # Expert 0 is used three times, then 1 once; 2 needs a slot: LRU drops 0 (used longer ago),
    # LFU drops 1 (used less often).
    seq = [0, 0, 0, 1, 2]
    assert _replay(SlotCache(2, LRU()), seq)[-1].evicted == 0
    assert _replay(SlotCache(2, LFU()), seq)[-1].evicted == 1


def test_lfru_keeps_a_frequent_expert_through_one_off_misses_until_it_idles():
    # 0 used three times, then 1 once: 2 evicts 1 (fewer uses per tick since last use), as LFU.
    assert _replay(SlotCache(2, LFRU()), [0, 0, 0, 1, 2])[-1].evicted == 1
    # After enough one-off misses 0's rate (3 uses over its idle ticks) falls below a newcomer's.
    evicted = [r.evicted for r in _replay(SlotCache(2, LFRU()), [0, 0, 0, 1, 2, 3, 4, 5])]
    assert evicted[4:6] == [1, 2] and 0 in evicted[6:]


def test_lfu_counts_survive_eviction():
    cache = SlotCache(2, LFU())
    _replay(cache, [1, 1, 1, 2, 2, 2, 2])  # 1 used 3 times, 2 used 4 times
    assert cache.access(0).evicted == 1  # fewer uses
    assert cache.access(1).evicted == 0  # 1 returns: 0 has 1 use, 2 has 4
    # 1 now has 4 uses over the run, as many as 2: the tie goes to the less recent, 2. A count
    # reset on eviction would give 1 a single use and evict it instead.
    assert cache.access(0).evicted == 2


@pytest.mark.parametrize("half_life", [8, HALF_LIFE])
def test_lfu_aging_forgets_an_old_burst_that_lfu_remembers(half_life):
    burst = [0] * (4 * half_life)
    steady = [1, 2] * (3 * half_life)  # 1 and 2 each end with fewer uses than 0's burst
    seq = burst + steady + [3]
    assert _replay(SlotCache(3, LFU()), seq)[-1].evicted == 1  # 0 still "most frequent"
    assert _replay(SlotCache(3, LFUAging(half_life)), seq)[-1].evicted == 0


def test_lfu_aging_halves_counts_every_half_life():
    policy = LFUAging(half_life=4)
    for now in range(4):
        policy.on_hit(7, now)
    assert policy.count(7, 3) == 4
    assert policy.count(7, 4) == 2
    assert policy.count(7, 4 * 10) == 4 / 2**10


def test_lfu_aging_stays_finite_over_a_long_run():
    policy = LFUAging(half_life=1)
    for now in range(5000):  # thousands of halvings: scaled scores would overflow without rescaling
        policy.on_hit(now % 3, now)
    assert 0 < policy.count(2, 4999) < 2
    assert policy.victim([0, 1, 2], 5000) == 4997 % 3  # the one last used longest ago: most decayed


@pytest.mark.parametrize("name", LIVE_POLICIES)
def test_unused_prefetches_leave_oldest_first(name):
    cache = SlotCache(3, make_policy(name))
    for e in (9, 4, 6):  # prefetched, never used: no uses to tell them apart, only recency
        cache.admit(e)
    assert cache.access(1).evicted == 9
    assert cache.access(2).evicted == 4
    assert cache.access(1).hit and cache.access(3).evicted == 6


def test_belady_evicts_the_expert_used_furthest_ahead():
    seq = [0, 1, 2, 0, 1, 3, 0]
    got = _replay(SlotCache(2, Belady(seq)), seq)
    assert [a.evicted for a in got] == [None, None, 1, None, 2, 1, None]
    assert [a.hit for a in got] == [False, False, False, True, False, False, True]


def test_belady_refuses_a_sequence_it_was_not_given():
    cache = SlotCache(2, Belady([0, 1]))
    cache.access(0)
    with pytest.raises(ValueError):
        cache.access(5)


calls_strategy = st.lists(st.sets(st.integers(0, 11), min_size=1, max_size=5), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(calls=calls_strategy, slots=st.integers(1, 12), pins=st.sets(st.integers(0, 11), max_size=3))
def test_belady_has_at_least_the_hits_of_every_live_policy(calls, slots, pins):
    pins = sorted(pins)[: max(0, slots - 1)]
    sequence = [e for needed in calls for e in sorted(needed)]

    def hits(policy) -> int:
        cache = SlotCache(slots, policy, pinned=pins)
        for needed in calls:
            cache.call(needed)
        return cache.hits

    best = hits(Belady(sequence))
    for name in LIVE_POLICIES:
        assert best >= hits(make_policy(name)), name


def test_make_policy_names_the_choices():
    assert set(LIVE_POLICIES) == set(POLICIES) == {"lru", "lfu", "lfu-aging", "lfru"}
    assert make_policy("LFU-Aging").name == "lfu-aging"
    with pytest.raises(MoekitError, match="lru, lfu, lfu-aging, lfru"):
        make_policy("fifo")
    with pytest.raises(MoekitError, match="cache-sim"):
        make_policy("belady")  # needs the future: not a live policy
