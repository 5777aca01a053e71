"""`moekit report`'s analysis of its trace, the fast paths against their references, in one process:
the hit-rate curve (every slot count × lru, lfu, belady) through moekit.analysis.replay against
SlotCache (simulate vs simulate_reference), and the co-activation counts as pairs against the
int64 product. Alternating rounds, medians; the results are checked equal as they are timed.

    .venv/bin/python -m moekit report --policies '' --trace /tmp/report.parquet --out /tmp/report.html
    PYTHONPATH=src .venv/bin/python benchmarks/report_analysis.py /tmp/report.parquet
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import pyarrow.parquet as pq

from moekit.analysis.cache_sim import simulate, simulate_reference, trace_calls
from moekit.analysis.hitrate import CURVE_POLICIES, slot_counts
from moekit.analysis.reuse_stats import coactivation_matrix
from moekit.analysis.trace_data import from_table


def curve(run, calls, experts: int) -> list:
    return [run(calls, p, s) for s in slot_counts(experts) for p in CURVE_POLICIES]


def int64_product(trace, layer: int) -> np.ndarray:
    hot = trace.onehot(layer).astype(np.int64)
    return hot.T @ hot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a routing trace (*.parquet), e.g. moekit report --trace's")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    table = pq.read_table(args.trace)
    trace = from_table(table, args.trace)
    calls = trace_calls(table.select(["step", "row", "layer", "expert_ids"]))
    experts = max(trace.experts.values())
    sides = {
        "hit-rate curve, SlotCache": lambda: curve(simulate_reference, calls, experts),
        "hit-rate curve, replay": lambda: curve(simulate, calls, experts),
        "co-activation, int64 product": lambda: [int64_product(trace, l) for l in trace.layers],
        "co-activation, pairs": lambda: [coactivation_matrix(trace, l) for l in trace.layers],
    }
    times: dict = {name: [] for name in sides}
    results: dict = {}
    print(f"{len(trace.layer):,} entries, {len(trace.layers)} layers × {experts} experts; "
          f"{calls.accesses:,} accesses a simulation; load {os.getloadavg()[0]:.1f}")
    for _ in range(args.rounds):
        for name, run in sides.items():
            began = time.perf_counter()
            results[name] = run()
            times[name].append(time.perf_counter() - began)
    assert results["hit-rate curve, SlotCache"] == results["hit-rate curve, replay"]
    assert all(np.array_equal(a, b) for a, b in zip(results["co-activation, int64 product"], results["co-activation, pairs"]))
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in median.items():
        print(f"  {name}: {seconds:.3f} s (median of {args.rounds})")
    print(f"  replay / SlotCache {median['hit-rate curve, replay'] / median['hit-rate curve, SlotCache']:.2f}×; "
          f"pairs / product {median['co-activation, pairs'] / median['co-activation, int64 product']:.4f}×; "
          f"load {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
