"""Eviction policies of one MoE layer's expert cache: which resident expert leaves to make room.

A policy only keeps score: the SlotCache (slot_cache.py) owns residency, pins and the clock, and
asks `victim` to choose among the experts it may evict. `now` is that cache's logical clock, one
tick per expert access (and per prefetch it admits). The calls a policy receives:

- `on_insert(e, now)`: e became resident, after a miss or by a prefetch. Not a use: a prefetch
  is a guess, and a guess that never comes true must not earn e frequency.
- `on_hit(e, now)`: a forward used e while it was resident. A miss is reported as on_insert then
  on_hit at the same `now` (e is admitted, then used).
- `on_evict(e)`: e left the cache.
- `victim(candidates, now)`: one of `candidates` (never empty, ascending ids) to evict. Policies
  rely on the ascending order for the last tie-break: `min` keeps the first of equal keys.

Every policy is deterministic: ties fall to the least recently used, then to the lowest id, so a
simulation and a live run of the same accesses evict the same experts.

No torch here: cache-sim uses these without the engine.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import Callable, Protocol, Sequence

from moekit.errors import MoekitError


class Policy(Protocol):
    name: str

    def on_insert(self, e: int, now: int) -> None: ...

    def on_hit(self, e: int, now: int) -> None: ...

    def on_evict(self, e: int) -> None: ...

    def victim(self, candidates: Sequence[int], now: int) -> int: ...


class LRU:
    """Evict the expert used longest ago: the baseline every other policy must beat."""

    name = "lru"

    def __init__(self) -> None:
        self._last: dict[int, int] = {}

    def on_insert(self, e: int, now: int) -> None:
        # A prefetched expert counts as fresh, else it would be the first victim before its use.
        self._last[e] = now

    def on_hit(self, e: int, now: int) -> None:
        self._last[e] = now

    def on_evict(self, e: int) -> None:
        self._last.pop(e, None)

    def victim(self, candidates: Sequence[int], now: int) -> int:
        return min(candidates, key=self._last.__getitem__)


class LFU:
    """Evict the expert used least often over the whole run (counts survive eviction, so an expert
    that routing favours comes back with its history); ties to the least recently used.

    Whole-run counts suit MoE routing, whose expert popularity is skewed and stable over a run;
    they adapt slowly when the text changes topic, which `lfu-aging` addresses.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}
        self._last: dict[int, int] = {}

    def on_insert(self, e: int, now: int) -> None:
        self._last[e] = now

    def on_hit(self, e: int, now: int) -> None:
        self._uses[e] = self._uses.get(e, 0) + 1
        self._last[e] = now

    def on_evict(self, e: int) -> None:
        pass  # the count is the expert's history, not its residency

    def victim(self, candidates: Sequence[int], now: int) -> int:
        uses, last = self._uses, self._last
        return min(candidates, key=lambda c: (uses.get(c, 0), last[c]))


# Counts halve every 256 accesses of the layer. One decoded token makes K accesses per layer
# (K = 2..8 in released models), so 256 accesses span 32..128 tokens: long enough that a cache
# turnover (slots accesses, 4..64 here) does not reset the ranking, short enough that a burst
# from a few hundred tokens ago (a code block, a language switch) fades within a paragraph.
HALF_LIFE = 256


class LFUAging:
    """Evict the expert with the lowest decayed use count: each use adds 1 and every count halves
    at each multiple of `half_life` on the clock, so an old burst is forgotten; ties to the least
    recently used.

    All counts halve at the same instants, so their order never depends on when decay is applied:
    scores are kept scaled by 2^(epochs since `base`) and compared as they are (power-of-two
    scaling is exact). Rescaling to a later base now and then keeps them far from overflow.
    """

    name = "lfu-aging"
    _RESCALE_EPOCHS = 512  # 2^512 is far below the float maximum (2^1024)

    def __init__(self, half_life: int = HALF_LIFE) -> None:
        if half_life < 1:
            raise ValueError(f"half_life must be >= 1, got {half_life}")
        self.half_life = half_life
        self._base = 0  # the epoch scores are scaled to
        self._score: dict[int, float] = {}  # e -> decayed count × 2^(epoch − base), any epoch
        self._last: dict[int, int] = {}

    def count(self, e: int, now: int) -> float:
        """e's decayed use count at clock `now`."""
        return math.ldexp(self._score.get(e, 0.0), self._base - now // self.half_life)

    def on_insert(self, e: int, now: int) -> None:
        self._last[e] = now

    def on_hit(self, e: int, now: int) -> None:
        epoch = now // self.half_life
        if epoch - self._base > self._RESCALE_EPOCHS:
            shift = self._base - epoch
            self._score = {k: math.ldexp(v, shift) for k, v in self._score.items()}
            self._base = epoch
        self._score[e] = self._score.get(e, 0.0) + math.ldexp(1.0, epoch - self._base)
        self._last[e] = now

    def on_evict(self, e: int) -> None:
        pass  # decay, not eviction, is what forgets

    def victim(self, candidates: Sequence[int], now: int) -> int:
        score, last = self._score, self._last
        return min(candidates, key=lambda c: (score.get(c, 0.0), last[c]))


class LFRU:
    """Least frequently-recently used: evict the expert with the fewest uses per tick since its last
    use, uses / (now − last + 1); ties to the least recently used. An expert used often but not
    lately loses to one used once just now only after `uses` ticks of idleness, so a hot expert
    survives a burst of one-off misses (LRU's failure) and a formerly hot one does not squat
    forever (LFU's). vLLM PR #37190 measured LFRU with 8 slots beating LRU with 16.
    """

    name = "lfru"

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}  # while resident; eviction forgets, as in LFU
        self._last: dict[int, int] = {}

    def on_insert(self, e: int, now: int) -> None:
        self._uses.setdefault(e, 0)
        self._last[e] = now

    def on_hit(self, e: int, now: int) -> None:
        self._uses[e] = self._uses.get(e, 0) + 1
        self._last[e] = now

    def on_evict(self, e: int) -> None:
        self._uses.pop(e, None)

    def victim(self, candidates: Sequence[int], now: int) -> int:
        uses, last = self._uses, self._last
        return min(candidates, key=lambda c: (uses.get(c, 0) / (now - last[c] + 1), last[c]))


class Belady:
    """Evict the expert whose next use is furthest in the future (never: furthest of all); ties to
    the lowest id. Optimal for a cache that must admit every miss (Belady's MIN), so it is the upper
    bound cache-sim reports, not a live policy: it needs the whole access sequence up front, in the
    order the SlotCache makes the accesses (its clock indexes the sequence).
    """

    name = "belady"

    def __init__(self, accesses: Sequence[int]) -> None:
        self._accesses = list(accesses)
        self._at: dict[int, list[int]] = {}  # e -> the clock values at which e is used, ascending
        for t, e in enumerate(self._accesses):
            self._at.setdefault(e, []).append(t)
        self._next: dict[int, float] = {}  # resident e -> the clock of its next use

    def _next_use(self, e: int, after: int, inclusive: bool) -> float:
        times = self._at.get(e, ())
        i = (bisect_left if inclusive else bisect_right)(times, after)
        return times[i] if i < len(times) else math.inf

    def on_insert(self, e: int, now: int) -> None:
        self._next[e] = self._next_use(e, now, inclusive=True)

    def on_hit(self, e: int, now: int) -> None:
        if now >= len(self._accesses) or self._accesses[now] != e:
            raise ValueError(f"belady: access {now} is expert {e}, but the sequence it was given says otherwise")
        self._next[e] = self._next_use(e, now, inclusive=False)

    def on_evict(self, e: int) -> None:
        self._next.pop(e, None)

    def victim(self, candidates: Sequence[int], now: int) -> int:
        return max(candidates, key=self._next.__getitem__)  # max keeps the first: the lowest id


POLICIES: dict[str, Callable[[], Policy]] = {"lru": LRU, "lfu": LFU, "lfu-aging": LFUAging, "lfru": LFRU}
LIVE_POLICIES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str) -> Policy:
    """A fresh policy for one layer of the live store (belady needs the future: cache-sim only)."""
    key = name.strip().lower()
    if key not in POLICIES:
        hint = " (belady needs the future: only cache-sim runs it)" if key == "belady" else ""
        raise MoekitError(f"unknown cache policy {name!r}{hint}; choose one of: {', '.join(POLICIES)}")
    return POLICIES[key]()
