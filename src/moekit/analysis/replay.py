"""A layer's expert cache replayed from its forwards: SlotCache.call's walk with each policy's
bookkeeping written into one loop, for simulations of hundreds of thousands of accesses.

Why: `moekit report` replays ~1.4M accesses (cache-sim's hit-rate curve: 8 cache sizes × 3
policies × the bundled model's 4 layers; eval-routing's paged hit rate: every policy's steps), and
through SlotCache and the policy objects each took 5-25 µs, most of it building and sorting the
candidates of every eviction and calling methods. Here a victim is the least (Belady: the most)
of the candidates under a rank kept per expert, ranks are unique (they end in a tick), so the
candidates need no sorting; LRU keeps its experts in the order of use and takes the first.

The reference is SlotCache with the policy classes (moekit.offload.slot_cache, .policies), the
code the live store runs: tests/analysis/test_replay.py holds the two to the same hits, misses and
evictions after every forward, for every policy, with pins and without. cache-sim replays a policy
this module does not know through the reference.

No torch here, as cache-sim.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

from moekit.offload.policies import HALF_LIFE, LFUAging

REPLAYED = ("lru", "lfu", "lfu-aging", "lfru", "belady")


def next_uses(sequence: Sequence[int]) -> list[float]:
    """For each access t, the clock of the same expert's next access (math.inf: none): what
    Belady's on_hit looks up at t."""
    out: list[float] = [math.inf] * len(sequence)
    seen: dict[int, int] = {}
    for t in range(len(sequence) - 1, -1, -1):
        e = sequence[t]
        if e in seen:
            out[t] = seen[e]
        seen[e] = t
    return out


class Replay:
    """One layer's cache under `policy` (one of REPLAYED): after `run` of forwards, the hits, misses
    and evictions a SlotCache(slots, policy, pinned) counts after `call` of each. Belady needs the
    layer's whole access sequence up front (`future`), as its class does; the others none.
    half_life: lfu-aging's, as LFUAging(half_life)."""

    def __init__(self, slots: int, policy: str, pinned: Iterable[int] = (), future: Optional[Sequence[int]] = None,
                 half_life: int = HALF_LIFE):
        if policy not in REPLAYED:
            raise ValueError(f"replay knows {', '.join(REPLAYED)}, not {policy!r}")
        if (policy == "belady") != (future is not None):
            raise ValueError("belady replays a given access sequence; the other policies take none")
        pinned = frozenset(int(e) for e in pinned)
        if slots < 1:
            raise ValueError(f"a cache needs at least 1 slot, got {slots}")
        if len(pinned) > slots - 1:
            raise ValueError(f"{len(pinned)} pinned experts need more than {slots} - 1 slots")
        if half_life < 1:
            raise ValueError(f"half_life must be >= 1, got {half_life}")
        self.slots, self.policy, self.pinned, self.half_life = slots, policy, pinned, half_life
        self.future = list(future) if future is not None else None
        self._next = next_uses(self.future) if future is not None else None
        # rank: the resident unpinned experts, each with its rank as the policy's victim() sees
        # it: the victim has the least (Belady: the most). Each rank ends in what no other
        # expert's has (its last use's tick, or Belady's id), so the candidates' order is moot.
        # lru's dict is kept in the order of use (its first key is the least recent); lfru's rank
        # changes with the clock: None here, computed at each eviction as LFRU.victim does.
        self._rank: dict[int, object] = {}
        self._last: dict[int, int] = {}  # lfru, lfu-aging: the tick of e's last use
        self._uses: dict[int, int] = {}  # lfu: over the run; lfru: while resident
        self._score: dict[int, float] = {}  # lfu-aging: decayed counts, scaled to 2^(epoch - base)
        self._base = 0
        self.clock = self.hits = self.misses = self.evictions = 0

    @property
    def resident(self) -> frozenset[int]:
        return frozenset(self._rank).union(self.pinned)

    def run(self, calls: Iterable[Sequence[int]]) -> None:
        """Forwards one after another, each the experts it needs (any order, repeats allowed)."""
        policy, pinned, nxt, future = self.policy, self.pinned, self._next, self.future
        free = self.slots - len(pinned)  # slots for the experts that come and go
        rank, last, uses, score, base = self._rank, self._last, self._uses, self._score, self._base
        half_life, rescale = self.half_life, LFUAging._RESCALE_EPOCHS
        clock, hits, misses, evictions = self.clock, self.hits, self.misses, self.evictions
        for needed in calls:
            order = sorted(set(needed))
            needed = set(order)
            for e in order:
                now = clock
                clock += 1
                if nxt is not None and (now >= len(nxt) or future[now] != e):
                    raise ValueError(f"belady: access {now} is expert {e}, but the sequence it was given says otherwise")
                if e in rank:
                    hits += 1
                elif e in pinned:
                    hits += 1
                    continue
                else:
                    misses += 1
                    if len(rank) >= free:
                        # As SlotCache.access: a victim outside the forward's experts; failing
                        # that, a finished one (every resident expert is the forward's: those
                        # below e); failing that, any.
                        if policy == "lru":
                            victim = next((k for k in rank if k not in needed), None)
                            if victim is None:
                                victim = next((k for k in rank if k < e), None)
                                if victim is None:
                                    victim = next(iter(rank))
                        else:
                            candidates = rank.keys() - needed
                            if not candidates:
                                candidates = [k for k in rank if k < e] or list(rank)
                            if policy == "belady":
                                victim = max(candidates, key=rank.__getitem__)
                            elif policy == "lfru":
                                victim = min(candidates, key=lambda c: (uses[c] / (now - last[c] + 1), last[c]))
                                del uses[victim]
                            else:
                                victim = min(candidates, key=rank.__getitem__)
                        del rank[victim]
                        evictions += 1
                # e used at `now` (a miss: admitted, then used at the same tick)
                if policy == "lru":
                    rank.pop(e, None)  # to the end: the most recent
                    rank[e] = now
                elif policy == "belady":
                    rank[e] = (nxt[now], -e)  # the furthest next use; ties to the lowest id
                elif policy == "lfu":
                    n = uses[e] = uses.get(e, 0) + 1
                    rank[e] = (n, now)
                elif policy == "lfru":
                    uses[e] = uses.get(e, 0) + 1
                    last[e] = now
                    rank[e] = None
                else:  # lfu-aging, as LFUAging.on_hit
                    epoch = now // half_life
                    if epoch - base > rescale:
                        shift = base - epoch
                        for k, v in score.items():
                            score[k] = math.ldexp(v, shift)
                        base = epoch
                        for k in rank:
                            rank[k] = (score[k], last[k])
                    s = score[e] = score.get(e, 0.0) + math.ldexp(1.0, epoch - base)
                    last[e] = now
                    rank[e] = (s, now)
        self._base = base
        self.clock, self.hits, self.misses, self.evictions = clock, hits, misses, evictions
