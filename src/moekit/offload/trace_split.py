"""`--expert-split TRACE`: each MoE layer's hit curve, measured by replaying a routing trace
(`moekit run ... --trace t.parquet`) through the store's own SlotCache at every slot count.

The curve is what the live store would score on that trace with s slots under the run's policy:
the same bookkeeping (SlotCache.call walks a forward as the store does), so the split it drives
(moekit.offload.budget.split_slots) is chosen on the hit rates the store itself would see. A
trace from another model is refused in one line. Replaying costs about 0.6 s a layer for a 200-token
trace at 128 experts (measured on the 2-core machine under load): ~30 s for Qwen3-30B-A3B's 48
layers, once at start. No torch here.
"""

from __future__ import annotations

from pathlib import Path

from moekit.errors import MoekitError
from moekit.offload.policies import make_policy
from moekit.offload.slot_cache import SlotCache


def hit_curves(path: Path, layers: list[int], num_experts: int, policy: str) -> dict[int, list[int]]:
    """layer → [hits with 0 slots, 1 slot, ..., num_experts slots] over the trace's forwards."""
    from moekit.analysis.cache_sim import read_trace  # the trace reader cache-sim uses

    trace = read_trace(path)
    if sorted(trace.layers) != sorted(layers) or trace.max_expert >= num_experts:
        raise MoekitError(f"{path}: this trace's routing is not this model's ({len(trace.layers)} MoE layers, expert "
                          f"ids up to {trace.max_expert}; the model has {len(layers)} layers of {num_experts})")
    curves = {}
    for layer in layers:
        calls = trace.calls[layer]
        # With as many slots as the layer's distinct experts nothing is ever evicted: every access
        # after an expert's first is a hit, whatever the slots beyond (the replay stops there).
        distinct = len({e for needed in calls for e in needed})
        row = [0]
        for slots in range(1, num_experts + 1):
            if slots > max(1, distinct):
                row.append(row[-1])
                continue
            cache = SlotCache(slots, make_policy(policy))
            for needed in calls:
                cache.call(needed)
            row.append(cache.hits)
        curves[layer] = row
    return curves
