"""Where the compiled decode step's start-up goes, in one process: load, then the first (compiling)
step, with torch's own compile-phase timers (Dynamo tracing, AOTAutograd, Inductor codegen and
C++ compile, loading cached code) and its cache hit/miss counters. `--no-saved` traces with Dynamo
even where an earlier process saved the graph (moekit.model.saved_graphs), for the A/B. Run it twice: the first run
with the model's folder under ~/.cache/moekit/compile removed has no graph of its own but still finds
the kernels other models built (the kernels-* folder beside it, shared by every model): remove that
too for "cold" (a fresh HOME would also rebuild moekit's operators, minutes more); the second run is "warm".

    PYTHONPATH=src .venv/bin/python benchmarks/compile_startup.py bench-out/ckpt/qwen3_moe-150m
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="dtype")
    parser.add_argument("--batches", default="1", help="comma-separated batch sizes to warm up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-saved", action="store_true",
                        help="trace the step with Dynamo even where a saved graph exists (moekit.model.saved_graphs)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    import moekit
    from moekit.engine.loader import load_engine

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    engine = load_engine(args.checkpoint, dtype=args.dtype, weights=args.weights, compile=True)
    t_load = time.perf_counter() - t1
    t2 = time.perf_counter()
    batches = tuple(int(b) for b in args.batches.split(","))
    if engine.decoder.compiled is not None:
        if args.no_saved:
            engine.decoder.compiled._saved = []
        engine.decoder.compiled.warm_up(batches)
    t_first = time.perf_counter() - t2
    from torch._dynamo.utils import calculate_time_spent, compile_times, counters

    print(json.dumps({
        "moekit": moekit.__file__,
        "import_s": round(t_import, 2), "load_s": round(t_load, 2), "first_steps_s": round(t_first, 2),
        "notes": engine.notes,
        "cache_folder": str(getattr(engine.decoder.compiled, "cache_folder", None)),
        "graphs_loaded_from_disk": getattr(engine.decoder.compiled, "loaded_graphs", None),
        "phases_s": {k: round(v, 2) for k, v in calculate_time_spent().items()},
        "counters": {group: dict(counters[group]) for group in ("inductor", "aot_autograd", "stats")},
    }, indent=1, default=str))
    print(compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main()
