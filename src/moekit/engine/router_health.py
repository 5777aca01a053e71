"""Router health: the entropy of each token's full routing distribution, its drift along the
sequence, and the inter-token-latency jitter of a request.

Entropy is of the distribution the router scores over all E experts (softmax of the logits; for a
sigmoid router, its scores normalised to sum 1), in nats; divided by ln E it is 1 for a uniform
router and 0 for a one-hot one. A trace records it per token × layer when the routers are watched
(`watch_entropy`), which costs a log-softmax over E per token and layer, off the default path.

Flags (thresholds stated, not tuned): a layer's entropy *collapses* when its mean normalised
entropy over the last position bucket is below COLLAPSE_RATIO of its first bucket's, or its mean
over all tokens is below COLLAPSE_FLOOR (nearly one-hot for every token); a request's ITL jitter
index (std / mean of its inter-token latencies) is *high* above JITTER_HIGH.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

COLLAPSE_RATIO = 0.5
COLLAPSE_FLOOR = 0.1
JITTER_HIGH = 0.5
POSITION_BUCKET = 64  # tokens per bucket of the drift table


def routing_entropy(logits, scoring: str = "softmax"):
    """logits [T, E] → [T] entropy (nats): moekit.model.routing.routing_entropy, which the decoder
    computes itself while watched (imported here only when called: this module needs no torch)."""
    from moekit.model.routing import routing_entropy as entropy

    return entropy(logits, scoring)


def watch_routers(decoder) -> Callable[[], None]:
    """From now on every MoE layer's RoutingDecision carries `entropy` [T], computed by the decoder
    from the router logits its pass already has (the modules' forward and the decode step, eager or
    compiled, alike: moekit.model.decoder.StepRouting.entropy). Returns the function that stops it."""
    decoder.entropy_watched = True

    def stop() -> None:
        decoder.entropy_watched = False

    return stop


@contextmanager
def watch_entropy(decoder) -> Iterator[None]:
    """watch_routers for the duration of a with-block."""
    stop = watch_routers(decoder)
    try:
        yield
    finally:
        stop()


@dataclass
class EntropyTally:
    """Running sums of normalised routing entropy per (MoE layer, position bucket): what a server
    accumulates over its decode steps and /metrics reads."""

    experts: dict[int, int]  # MoE layer -> E
    bucket: int = POSITION_BUCKET
    cells: dict = field(default_factory=dict)  # (layer, bucket start) -> [sum, count]

    def add(self, layer: int, positions: Sequence[int], entropy: Sequence[float]) -> None:
        scale = math.log(self.experts[layer]) if self.experts.get(layer, 0) > 1 else 0.0
        for position, h in zip(positions, entropy):
            cell = self.cells.setdefault((layer, position // self.bucket * self.bucket), [0.0, 0])
            cell[0] += h / scale if scale else 0.0
            cell[1] += 1

    def snapshot(self) -> dict:
        return {key: (s / n, n) for key, (s, n) in list(self.cells.items()) if n}


def jitter_index(token_times: Sequence[float]) -> Optional[float]:
    """std / mean of the gaps between consecutive tokens (None with fewer than two gaps)."""
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    if len(gaps) < 2:
        return None
    mean = sum(gaps) / len(gaps)
    if mean <= 0:
        return None
    return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean


@dataclass(frozen=True)
class Drift:
    """One MoE layer's mean normalised entropy per position bucket."""

    layer: int
    buckets: list[tuple[int, float, int]]  # (first position, mean normalised entropy, tokens)
    mean: float

    @property
    def collapses(self) -> bool:
        first, last = self.buckets[0][1], self.buckets[-1][1]
        return self.mean < COLLAPSE_FLOOR or (len(self.buckets) > 1 and last < COLLAPSE_RATIO * first)


def entropy_drift(layers: Sequence[int], positions: Sequence[int], entropy: Sequence[float],
                  experts: dict[int, int], bucket: int = POSITION_BUCKET) -> list[Drift]:
    """Per token × layer records (layer, position, entropy in nats) → each layer's drift."""
    sums: dict[int, dict[int, list[float]]] = {}
    for layer, position, h in zip(layers, positions, entropy):
        if h is None or h != h:
            continue
        cell = sums.setdefault(int(layer), {}).setdefault(int(position) // bucket, [0.0, 0])
        cell[0] += h / math.log(experts[int(layer)]) if experts[int(layer)] > 1 else 0.0
        cell[1] += 1
    out = []
    for layer in sorted(sums):
        cells = sorted(sums[layer].items())
        total = sum(c[1] for _, c in cells)
        out.append(Drift(layer, [(b * bucket, c[0] / c[1], c[1]) for b, c in cells], sum(c[0] for _, c in cells) / total))
    return out


def health_flags(drift: Sequence[Drift], jitters: dict[str, Optional[float]]) -> list[str]:
    """One line per flagged layer or request."""
    lines = []
    for d in drift:
        if d.collapses:
            lines.append(f"layer {d.layer}: routing entropy collapses (normalised {d.buckets[0][1]:.3f} at positions "
                         f"{d.buckets[0][0]}+, {d.buckets[-1][1]:.3f} at {d.buckets[-1][0]}+, mean {d.mean:.3f}; "
                         f"flagged below {COLLAPSE_RATIO:g}× the first bucket or {COLLAPSE_FLOOR:g} overall)")
    for name, j in jitters.items():
        if j is not None and j > JITTER_HIGH:
            lines.append(f"{name}: ITL jitter index {j:.2f} (std/mean of inter-token latency; flagged above {JITTER_HIGH:g})")
    return lines
