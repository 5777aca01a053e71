"""Hit rate by policy and budget on a real workload: the live store vs cache-sim on the same trace.

For each budget and live policy, one process-lifetime engine serves a fixed set of prompts from
the demo model's five domains, one after another (the cache stays warm across prompts, as in a
server). Without prefetch the live hit rate must equal cache-sim's replay of the run's own trace;
Belady (which knows the future) is the bound no policy can pass. With prefetch the live hit rate,
precision and recall are reported too.

    .venv/bin/python benchmarks/offload_policies.py models/moekit-demo --out bench-out/results/policies.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moekit.engine.loader import load_engine
from moekit.engine.trace import trace_table
from moekit.analysis.cache_sim import simulate_layer, trace_calls
from moekit.offload.options import OffloadOptions
from moekit.offload.policies import LIVE_POLICIES, Belady, make_policy
from moekit.offload.slot_cache import SlotCache

PROMPTS = [
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(",
    "NAME\n       tar - an archiving utility\n\nSYNOPSIS\n",
    "#!/bin/sh\nset -e\n\nif [ -z \"$1\" ]; then\n",
    "A journey of a thousand miles",
    "名称\n       ls - 列出目录内容\n\n描述\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "DESCRIPTION\n       The ssh client connects to",
    "for f in *.txt; do\n",
]


def run_config(folder: str, budget: str, policy: str, prefetch: bool, new_tokens: int, extra: int = 2) -> dict:
    options = OffloadOptions(budget, policy=policy, prefetch=prefetch, prefetch_extra=extra)
    engine = load_engine(folder, dtype="bfloat16", offload=options, compile=False)
    calls: dict[int, list[tuple[int, ...]]] = {}
    began = time.perf_counter()
    decode_s = decode_tokens = 0.0
    try:
        with torch.inference_mode():
            for prompt in PROMPTS:
                gen = engine.generate(prompt, max_new_tokens=new_tokens, stop_ids=())
                decode_s += gen.timing.decode_s
                decode_tokens += gen.timing.decode_tokens
                for layer, forwards in trace_calls(trace_table(gen)).calls.items():
                    calls.setdefault(layer, []).extend(forwards)
        stats = engine.store.stats()
    finally:
        engine.close()
    return {"stats": stats, "calls": calls, "wall_s": time.perf_counter() - began,
            "decode_tok_s": decode_tokens / decode_s}


def simulate(calls: dict[int, list[tuple[int, ...]]], policy: str, slots: int) -> float:
    hits = accesses = 0
    for layer, forwards in calls.items():
        chosen = Belady([e for c in forwards for e in c]) if policy == "belady" else make_policy(policy)
        result = simulate_layer(forwards, SlotCache(slots, chosen), first_is_prefill=False)
        hits += result.hits
        accesses += result.hits + result.misses
    return hits / accesses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", default="models/moekit-demo")
    parser.add_argument("--budgets", default="12.5%,25%,50%")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--policies", default=",".join(LIVE_POLICIES))
    parser.add_argument("--prefetch-extra", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for budget in args.budgets.split(","):
        for policy in args.policies.split(","):
            cold = run_config(args.folder, budget, policy, prefetch=False, new_tokens=args.new_tokens)
            warm = run_config(args.folder, budget, policy, prefetch=True, new_tokens=args.new_tokens,
                              extra=args.prefetch_extra)
            slots = cold["stats"]["slots_per_layer"]
            row = {
                "budget": budget,
                "slots": slots,
                "policy": policy,
                "live_hit_rate": cold["stats"]["hit_rate"],
                "sim_hit_rate": simulate(cold["calls"], policy, slots),
                "belady_hit_rate": simulate(cold["calls"], "belady", slots),
                "prefetch_extra": args.prefetch_extra,
                "prefetch_hit_rate": warm["stats"]["hit_rate"],
                "prefetch_recall": warm["stats"]["prefetch_recall"],
                "prefetch_precision": warm["stats"]["prefetch_precision"],
                "decode_tok_s_no_prefetch": cold["decode_tok_s"],
                "decode_tok_s_prefetch": warm["decode_tok_s"],
            }
            rows.append(row)
            print(f"{budget:>6} {policy:>9} slots {slots:3d}  live {row['live_hit_rate']:.3f}  sim {row['sim_hit_rate']:.3f}  "
                  f"belady {row['belady_hit_rate']:.3f}  | prefetch: hit {row['prefetch_hit_rate']:.3f} "
                  f"recall {row['prefetch_recall']:.3f} precision {row['prefetch_precision']:.3f} | tok/s "
                  f"{row['decode_tok_s_no_prefetch']:.0f} → {row['decode_tok_s_prefetch']:.0f}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"prompts": PROMPTS, "new_tokens": args.new_tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
