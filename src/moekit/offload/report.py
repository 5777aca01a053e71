"""The store's figures for one generation, split at the prefill: what `--json` and `--show-activation` show.

`hit_rate` counts every forward, the prompt pass included, and `decode_hit_rate` the decode steps
alone: the names and meanings of `ExpertStore.stats()` and of cache-sim.

Decode figures are per generated token after the first (the prefill produced the first); the
prefill's loads are reported apart, since a long prompt reads many experts once. No torch here.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """This process's peak resident set. On Linux, VmHWM of /proc/self/status: getrusage's ru_maxrss
    survives exec, so a child started by a big process would report its parent's peak (it did)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _delta(after: dict, before: dict, key: str):
    return after[key] - before.get(key, 0)


def offload_report(after_prefill: dict, final: dict, decode_tokens: int, decode_s: float) -> dict:
    """after_prefill / final: ExpertStore.stats() snapshots; decode_tokens: tokens from decode steps."""
    accesses = _delta(final, after_prefill, "accesses")
    hits = sum(final["layers"][l]["hits"] - after_prefill["layers"][l]["hits"] for l in final["layers"])
    stall = final["stall_s"] - after_prefill["stall_s"]
    disk = _delta(final, after_prefill, "disk_bytes")
    per_layer = {}
    for l, now in final["layers"].items():
        then = after_prefill["layers"][l]
        n = now["accesses"] - then["accesses"]
        per_layer[l] = (now["hits"] - then["hits"]) / n if n else None
    decode_hit_rate = hits / accesses if accesses else None
    return {
        **{k: final[k] for k in ("policy", "slots_per_layer", "prefetch", "expert_bytes", "budget_bytes", "pinned")},
        # As store.stats() and cache-sim name them: every forward, then the decode steps alone.
        "hit_rate": final["hit_rate"],
        "decode_hit_rate": decode_hit_rate,
        "prefill": {"loads": after_prefill["loads"], "disk_bytes": after_prefill["disk_bytes"],
                    "stall_s": after_prefill["stall_s"]},
        "decode": {
            "tokens": decode_tokens,
            "hit_rate": decode_hit_rate,  # = decode_hit_rate above (kept for readers of this block)
            "hit_rate_per_layer": per_layer,
            "disk_bytes_per_token": disk / decode_tokens if decode_tokens else None,
            "stall_s_per_token": stall / decode_tokens if decode_tokens else None,
            "stall_share": stall / decode_s if decode_s > 0 else None,
        },
        "prefetch_precision": final["prefetch_precision"],
        "prefetch_recall": final["prefetch_recall"],
        "peak_resident_expert_bytes": final["peak_resident_expert_bytes"],
        "peak_held_expert_bytes": final["peak_held_expert_bytes"],
        "peak_rss_bytes": peak_rss_bytes(),
        "layers": final["layers"],
    }
