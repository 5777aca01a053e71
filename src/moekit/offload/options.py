"""What a user asks of the expert store (`moekit run --expert-memory ... --cache ... --pin ...`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

NO_CACHE = "none"  # the baseline that reads every expert on every use


@dataclass(frozen=True)
class OffloadOptions:
    expert_memory: str  # "25%", "2GiB", a byte count: what routed experts may hold in memory
    policy: str = "lru"  # a live policy name (moekit.offload.policies) or NO_CACHE
    pin: Optional[Path] = None  # a profile from `moekit profile`: its experts stay resident
    # Guess each layer's experts from the residual stream ahead of it and read them on worker
    # threads. Off by default: on the 2-core CPU it was measured on, the wrong guesses' reads cost
    # more than the right ones save (docs/BENCHMARKS.md); with spare cores and a slow disk it pays.
    prefetch: bool = False
    prefetch_extra: int = 4  # experts guessed per token beyond its K: recall 87% on the demo model
    workers: int = 2  # threads reading experts from disk
    # Misses read on the workers in parallel and behind the compute: a forward whose experts fit
    # the slots starts all its misses at once; a longer prompt keeps this many reads under way
    # ahead of the expert running.
    # 0 reads each miss inline, one after another (the reference; the same tokens either way).
    read_ahead: int = 2
    # A routing trace (`moekit run --trace`): the budget's slots are split across layers by the hit
    # rate each layer scores on it at every slot count, instead of equally.
    split: Optional[Path] = None
    # Read experts with O_DIRECT: the page cache keeps no second copy of what the store holds (the
    # machine's memory, not this process's RSS); each read costs a copy out of a bounce buffer.
    direct_io: bool = False
    substitute: Optional[str] = None  # "int4": a miss runs the expert's resident int4 copy (offload/substitute.py)
