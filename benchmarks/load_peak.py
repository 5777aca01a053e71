"""Peak RSS of a paged GGUF's load and first tokens, the load's phase apart, in this process.

    .venv/bin/python benchmarks/load_peak.py FILE.gguf 2GiB [--dtype bfloat16] [--weights int8] [--tokens 4]

One JSON line: the peak VmRSS sampled every 5 ms (moekit.bench.offload_rss) while load_engine ran
(`load_peak_gib`) and while a greedy 4-id prompt generated (`gen_peak_gib`), the kernel's VmHWM over
the whole process, the dense weights as held (`decoder.parameters()`), the store's bytes at the end,
the load's seconds and the tokens. Eager decode (compile=False): a first compile's memory is the
compiler's, not the load's. Run each configuration in its own process (VmHWM is per process); to
compare two trees, run this file under each tree's PYTHONPATH, alternating. Nothing here is
imported by moekit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from moekit.bench.offload_rss import RssSampler

GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("budget", help="--expert-memory, e.g. 2GiB")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--tokens", type=int, default=4)
    args = ap.parse_args()
    held: dict = {}
    sampler = RssSampler(probes={"store_bytes": lambda: held["engine"].store.clock.resident_bytes})
    with sampler:
        sampler.mark("started")
        from moekit.engine.loader import load_engine
        from moekit.offload.options import OffloadOptions

        began = time.perf_counter()
        engine = load_engine(args.gguf, dtype=args.dtype, offload=OffloadOptions(args.budget), weights=args.weights,
                             compile=False)
        load_s = time.perf_counter() - began
        held["engine"] = engine
        sampler.mark("loaded")
        gen = engine.generate([[1, 2, 3, 4]], max_new_tokens=args.tokens, stop_ids=())
        sampler.mark("generated")
        dense = sum(p.numel() * p.element_size() for p in engine.decoder.parameters())
        engine.close()
    report = sampler.report()

    def gib(value: int) -> float:
        return round(value / GIB, 3)

    print(json.dumps({
        "budget": args.budget, "dtype": args.dtype, "weights": args.weights, "load_s": round(load_s, 1),
        "tokens": gen.token_ids[0], "dense_gib": gib(dense), "vm_hwm_gib": gib(report["vm_hwm"]),
        "load_peak_gib": gib(report["marks"]["loaded"]["peak"].get("VmRSS", 0)),
        "gen_peak_gib": gib(report["marks"]["generated"]["peak"].get("VmRSS", 0)),
        "store_gib_at_end": gib(report["marks"]["generated"]["at"].get("store_bytes", 0)),
    }))


if __name__ == "__main__":
    main()
