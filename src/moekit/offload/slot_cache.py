"""Which experts of one MoE layer are resident: the bookkeeping the live store and cache-sim share.

The live store walks each forward with `forward` (cache-sim with `call`, the same walk) and asks
`admit` for each prefetch; cache-sim replays a routing trace through the same methods. Sharing this
one class is what makes a simulated hit rate equal the live one for the same accesses.

A layer forward needs a set of distinct experts; it takes them in ascending id order. While taking
one it never evicts one still to come, and evicts one it has finished with only when nothing else
can go: so when the needed experts fit, they are all resident when the forward ends (the next
token often reuses them). A forward that needs more experts than there are slots (a long prefill)
evicts finished ones, or, when all are still to come, any but the one it is taking.

No torch here: cache-sim uses this without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Iterator, Optional, Sequence

from moekit.offload.policies import Policy


@dataclass(frozen=True)
class Access:
    hit: bool
    evicted: Optional[int]  # the expert that left to make room, if any


_HIT = Access(hit=True, evicted=None)  # shared: an access is made per expert per forward
_MISS = Access(hit=False, evicted=None)


COLD = 1 << 40  # a guess enters this many ticks in the past: older than any use, in guess order


def most_pins(slots: int) -> int:
    """Pins one layer may hold: half its slots, so the other half follows the prompt (a profile
    from another workload must not crowd out what this one uses). The live store and cache-sim cap
    the same way, or their hit rates would not compare."""
    return slots // 2


class SlotCache:
    def __init__(self, slots: int, policy: Policy, pinned: Iterable[int] = ()):
        pinned = frozenset(int(e) for e in pinned)
        if slots < 1:
            raise ValueError(f"a cache needs at least 1 slot, got {slots}")
        if len(pinned) > slots - 1:
            # One slot must stay free for the experts that come and go.
            raise ValueError(f"{len(pinned)} pinned experts need more than {slots} - 1 slots")
        self.slots = slots
        self.policy = policy
        self._pinned = pinned
        self._resident: set[int] = set(pinned)  # pinned experts are outside the policy's view
        # One tick per access and per admitted prefetch: every event has its own time, so a
        # prefetched expert is newer than what came before it and older than the next use.
        # Without prefetch the clock counts accesses, which is what Belady's sequence indexes.
        self.clock = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.prefetched = 0

    @property
    def resident(self) -> frozenset[int]:
        return frozenset(self._resident)

    @property
    def pinned(self) -> frozenset[int]:
        return self._pinned

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    def __contains__(self, e: int) -> bool:
        return e in self._resident

    def _evictable(self, e: int, *exclude: Collection[int]) -> list[int]:
        """Resident experts that may leave for e, ascending (policies break ties by order)."""
        free = self._resident.difference(self._pinned, *exclude)
        free.discard(e)
        return sorted(free)

    def _evict(self, candidates: Sequence[int], now: int) -> int:
        victim = self.policy.victim(candidates, now)
        if victim not in candidates:
            raise ValueError(f"policy {self.policy.name} chose expert {victim}, not one of {list(candidates)}")
        self._resident.discard(victim)
        self.policy.on_evict(victim)
        self.evictions += 1
        return victim

    def access(self, e: int, protect: Collection[int] = (), keep: Collection[int] = ()) -> Access:
        """One use of expert e by a forward: a hit, or a miss that admits e (evicting if full).
        A victim comes from outside `protect` and `keep` (the forward's experts still to come and
        finished); failing that, outside `protect`; failing that, anything unpinned but e."""
        now = self.clock
        self.clock += 1
        if e in self._resident:
            self.hits += 1
            if e not in self._pinned:
                self.policy.on_hit(e, now)
            return _HIT
        self.misses += 1
        evicted = None
        if len(self._resident) >= self.slots:
            # Pins fill at most slots − 1, so a full cache always has an unpinned expert to drop.
            candidates = self._evictable(e, protect, keep) or self._evictable(e, protect) or self._evictable(e)
            evicted = self._evict(candidates, now)
        self._resident.add(e)
        self.policy.on_insert(e, now)
        self.policy.on_hit(e, now)
        return _MISS if evicted is None else Access(hit=False, evicted=evicted)

    def admit(self, e: int, protect: Collection[int] = ()) -> Optional[int]:
        """A prefetch: make e resident without counting a hit or a miss. Returns the evicted expert,
        or None (room was free, e was already resident, or every candidate is protected: then e is
        not admitted, which the caller sees as `e not in cache`)."""
        if e in self._resident:
            return None
        evicted = None
        now = self.clock
        if len(self._resident) >= self.slots:
            candidates = self._evictable(e, protect)
            if not candidates:
                return None
            evicted = self._evict(candidates, now)
        self.clock += 1
        self._resident.add(e)
        # A guess enters at the cold end: if it is wrong it is the first to leave, instead of
        # pushing out an expert that was really used (measured on the 2 GB checkpoint at 25%: with
        # guesses entering as fresh, prefetch raised disk reads per token from 5.1 MB to 9.9 MB and
        # made decoding slower). Its first real use (on_hit) makes it fresh.
        self.policy.on_insert(e, now - COLD)
        self.prefetched += 1
        return evicted

    def discard(self, e: int) -> None:
        """Forget e without counting an eviction: its load failed, so it must not count as resident.
        A pinned expert stops being pinned (the run is failing; nothing should trust it)."""
        if e in self._resident:
            self._resident.discard(e)
            self.policy.on_evict(e)
        self._pinned = self._pinned - {e}

    def forward(self, needed: Iterable[int]) -> Iterator[tuple[int, Access]]:
        """One layer forward, one expert at a time: yields (e, its access) in ascending id order, so
        the caller can run e before the next access may evict it. `needed`: the distinct experts
        the forward's tokens chose, in any order."""
        order = sorted(set(needed))
        remaining = set(order)
        finished: set[int] = set()
        for e in order:
            remaining.discard(e)
            yield e, self.access(e, remaining, finished)
            finished.add(e)

    def call(self, needed: Iterable[int]) -> list[Access]:
        """One whole layer forward (cache-sim): the accesses `forward` makes, in its order. The
        same walk without a generator, which cache-sim's millions of accesses notice."""
        order = sorted(set(needed))
        remaining = set(order)
        finished: set[int] = set()
        out = []
        for e in order:
            remaining.discard(e)
            out.append(self.access(e, remaining, finished))
            finished.add(e)
        return out
