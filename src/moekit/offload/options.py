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
    prefetch: bool = True  # guess each layer's experts from the residual stream ahead of it
    prefetch_extra: int = 2  # experts guessed per token beyond its K (recall for a little more reading)
    workers: int = 2  # threads reading experts from disk
