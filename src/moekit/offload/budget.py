"""`--expert-memory`: a byte budget for routed experts, and how many experts per layer it buys.

The budget covers routed experts only; dense weights (attention, embeddings, routers, shared
experts) are resident regardless. It is split evenly across MoE layers, because every token visits
every layer: a layer starved of slots would miss on every token whatever the others hold.

Experts packed at several precisions (moekit.offload.precision) differ in size; a slot is sized
for the largest, so no mix of resident experts exceeds the budget, and a budget that covers every
expert's own bytes holds them all.

No torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moekit.calc.units import nbytes
from moekit.errors import MoekitError

UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
EXAMPLES = "e.g. 25%, 12.5%, 2GiB, 512MiB, 1.5GB, 123456"

_BUDGET = re.compile(r"^(?P<value>[+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*(?P<unit>%|[kmgt]i?b|b)?$")


def parse_budget(text: str, total_expert_bytes: int) -> int:
    """Bytes for routed experts: a share of `total_expert_bytes` ("25%") or a size ("2GiB", "1e9").
    More than the total is clamped to the total (the caller reports a fully resident run)."""
    if total_expert_bytes <= 0:
        raise MoekitError("--expert-memory needs a model with routed experts; this one has none")
    match = _BUDGET.match(str(text).strip().lower())
    if match is None:
        raise MoekitError(f"--expert-memory {text!r}: expected a share or a size ({EXAMPLES})")
    value = float(match["value"])
    if value <= 0:
        raise MoekitError(f"--expert-memory {text!r}: must be above zero ({EXAMPLES})")
    unit = match["unit"]
    if unit == "%":
        budget = total_expert_bytes * value / 100
    else:
        budget = value * UNITS[unit or "b"]
    return min(int(budget), total_expert_bytes)


def parse_size(text: str, flag: str) -> int:
    """Bytes from a size ("1GiB", "512MiB", "1e9", "0"); zero allowed (it turns a cache off)."""
    match = _BUDGET.match(str(text).strip().lower())
    if match is None or match["unit"] == "%":
        raise MoekitError(f"{flag} {text!r}: expected a size (e.g. 1GiB, 512MiB, 1.5GB, 0 for none)")
    value = float(match["value"])
    if value < 0:
        raise MoekitError(f"{flag} {text!r}: must not be negative")
    return int(value * UNITS[match["unit"] or "b"])


@dataclass(frozen=True)
class SlotPlan:
    slots: int  # experts resident per MoE layer
    expert_bytes: int  # one routed expert in memory
    n_layers: int  # MoE layers sharing the budget
    budget_bytes: int  # the budget as given
    fully_resident: bool  # every expert fits: slots == num_experts
    clamped: bool  # the budget exceeds what every expert needs; slots were capped at num_experts

    @property
    def used_bytes(self) -> int:
        return self.slots * self.expert_bytes * self.n_layers


def plan_slots(
    budget_bytes: int,
    expert_bytes: int,
    n_moe_layers: int,
    num_experts: int,
    top_k: int,
    text: str | None = None,
    total_bytes: int | None = None,
) -> SlotPlan:
    """Slots per layer = floor(budget / (expert bytes × layers)), capped at num_experts. Below
    top_k slots one token's own experts would evict each other, so that is the minimum.
    `text` is the user's --expert-memory, quoted in the error. `total_bytes`: every expert's own
    bytes summed, when they differ (expert_bytes is then the largest); a budget of at least that
    holds every expert."""
    if expert_bytes <= 0 or n_moe_layers <= 0 or num_experts <= 0:
        raise MoekitError("--expert-memory needs a model with routed experts; this one has none")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts}")
    per_slot = expert_bytes * n_moe_layers  # one more slot in every layer
    fits = budget_bytes // per_slot
    if total_bytes is not None and budget_bytes >= total_bytes:
        fits = max(fits, num_experts)
    if fits < top_k:
        minimum = top_k * per_slot
        share = minimum / (num_experts * per_slot if total_bytes is None else total_bytes)
        given = text if text is not None else nbytes(budget_bytes)
        raise MoekitError(
            f"--expert-memory {given} is below the minimum: {top_k} experts per layer × {n_moe_layers} "
            f"layers = {nbytes(minimum)} ({share:.1%} of expert bytes)"
        )
    slots = min(fits, num_experts)
    return SlotPlan(
        slots=slots,
        expert_bytes=expert_bytes,
        n_layers=n_moe_layers,
        budget_bytes=budget_bytes,
        fully_resident=slots == num_experts,
        clamped=budget_bytes > (num_experts * per_slot if total_bytes is None else total_bytes),
    )


def split_slots(curves: dict[int, list[int]], slots: int, low: int) -> dict[int, int]:
    """`slots` × layers split by measured hit curves rather than `slots` each. curves[layer][s]: the
    hits that layer's accesses of a routing trace score with s slots (moekit.offload.trace_split
    replays them through the store's own SlotCache), s = 0..E. A layer whose accesses come back to
    a few experts gains little from more slots; one that cycles through many gains more.

    Greedy with look-ahead (utility-based cache partitioning, Qureshi & Patt 2006): each move
    gives the k slots with the most hits per slot to one layer (ties: fewer slots k, then the layer
    holding fewer, then the lower), so a curve that is flat before a step still gets its step.
    Every layer keeps at least `low` (top-k); if the split would score fewer hits on the curves
    than the equal one, the equal one is returned. No torch here."""
    if not curves:
        return {}
    equal = {layer: min(slots, len(c) - 1) for layer, c in curves.items()}
    out = {layer: min(low, len(c) - 1) for layer, c in curves.items()}
    left = sum(equal.values()) - sum(out.values())
    while left > 0:
        best, best_key = None, None
        for layer in sorted(curves):
            c, n = curves[layer], out[layer]
            for k in range(1, min(left, len(c) - 1 - n) + 1):
                key = ((c[n + k] - c[n]) / k, -k, -n, -layer)
                if best_key is None or key > best_key:
                    best, best_key = (layer, k), key
        if best is None:
            break
        out[best[0]] += best[1]
        left -= best[1]

    def hits(split: dict[int, int]) -> int:
        return sum(curves[layer][n] for layer, n in split.items())

    return out if hits(out) >= hits(equal) else equal
