"""`moekit serve` with the scheduler's prefill steps timed: the Python around a prompt's prefill graph
(its own cache made, its first token placed, its metering) against the graph's call, per request,
printed when the server stops (Ctrl-C). Drive it with any client, e.g. benchmarks/ttft_after.py:

  PYTHONPATH=src .venv/bin/python benchmarks/prefill_python_split.py bench-out/ckpt/qwen3_moe-150m --max-batch 16 --max-context 72 --threads 2 --port 8741
"""

from __future__ import annotations

import atexit
import collections
import functools
import sys
import time

import moekit.engine.scheduler as scheduler
import moekit.model.decoder as decoder
from moekit.cli import main

TIMED = [(scheduler.Scheduler, "_start_fill"), (decoder.Decoder, "new_cache"), (scheduler.Scheduler, "_fill_chunk"),
         (scheduler.Scheduler, "_end_fill"), (scheduler.Scheduler, "_place"), (scheduler.Scheduler, "_meter_prompt"),
         (scheduler.Scheduler, "_keep_blocks"), (scheduler.Scheduler, "_finish")]


def timed(owner, name: str, totals: dict) -> None:
    """owner.name, counting its calls and seconds into totals[name]."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def call(*args, **kwargs):
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            entry = totals[name]
            entry[0] += 1
            entry[1] += time.perf_counter() - began

    setattr(owner, name, call)


def report(totals: dict) -> None:
    for name, (calls, seconds) in totals.items():
        if calls:
            sys.stderr.write(f"{name:14s} {calls:5d} calls, mean {1000 * seconds / calls:7.3f} ms\n")


if __name__ == "__main__":
    totals: dict = collections.defaultdict(lambda: [0, 0.0])
    for owner, name in TIMED:
        timed(owner, name, totals)
    atexit.register(report, totals)
    sys.argv = ["moekit", "serve", *sys.argv[1:]]
    main()
