"""What compiling the prefill graphs beside the steps costs the requests of a server that just
started (moekit.model.compiled_step.CompiledStep.warm_up_prefills on its own thread, as `moekit
serve` does once it answers): batch-1 greedy decode (a prompt of 8 tokens, 32 new, its prefill on the
modules' forward while no graph of its shape is ready) timed before the compile begins (the named
baseline), while it runs, and after its graphs are ready, in one process. Prints each phase's
median tokens/s and its ratio to the baseline, and each prefill graph's line.

The graphs compile into an empty folder of their own (a cold start's), the decode graph first.

  PYTHONPATH=src .venv/bin/python benchmarks/prefill_graphs_beside.py bench-out/ckpt/qwen3_moe-150m [float32]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from moekit.engine.loader import load_engine
from moekit.model.compiled_step import SERVED_PREFILLS, CompiledStep

PROMPT = [5, 9, 33, 7, 81, 14, 3, 60]
NEW = 32


def tokens_per_s(engine) -> float:
    start = time.perf_counter()
    engine.generate([PROMPT], max_new_tokens=NEW, stop_ids=())
    return NEW / (time.perf_counter() - start)


def main(checkpoint: str, dtype: str = "float32", threads: int = 2) -> None:
    torch.set_num_threads(threads)
    engine = load_engine(checkpoint, dtype=dtype)
    with tempfile.TemporaryDirectory() as folder:
        step = CompiledStep(engine.decoder, cache=Path(folder))
        engine.decoder.compiled = step
        print(f"decode graph (batch 1), cold: {step.warm_up((1,)):.1f} s", flush=True)
        want = engine.generate([PROMPT], max_new_tokens=NEW, stop_ids=()).token_ids
        before = [tokens_per_s(engine) for _ in range(6)][1:]
        said: list[str] = []
        beside = threading.Thread(target=step.warm_up_prefills, args=(SERVED_PREFILLS, said.append))
        began = time.perf_counter()
        beside.start()
        during = []
        while beside.is_alive():
            during.append(tokens_per_s(engine))
        compile_s = time.perf_counter() - began
        after = [tokens_per_s(engine) for _ in range(6)][1:]
        assert engine.generate([PROMPT], max_new_tokens=NEW, stop_ids=()).token_ids == want
    base = statistics.median(before)
    for line in said:
        print(line)
    print(f"prefill graphs beside the steps: {compile_s:.1f} s")
    for name, runs in (("before (baseline)", before), ("while compiling", during), ("after", after)):
        median = statistics.median(runs)
        print(f"{name}: {median:.1f} tok/s over {len(runs)} runs, {median / base:.2f}x the baseline")


if __name__ == "__main__":
    main(*sys.argv[1:2], *sys.argv[2:3], *map(int, sys.argv[3:4]))
