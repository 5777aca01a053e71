"""A served prompt's prefill: the compiled graph (moekit.model.prefill_step) against the modules'
eager forward, on one decoder in one process, the two alternating; prints each one's median and the
ratio (eager ÷ compiled) per prompt shape, and one decode step's time beside them.

The shapes are the server's (moekit.model.compiled_step.SERVED_PREFILLS): one row filling its own
cache (a lone request), a burst of rows prefilled together, one row leaving room (a chunk).

  PYTHONPATH=src .venv/bin/python benchmarks/prefill_compiled_ab.py bench-out/ckpt/qwen3_moe-150m float32
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from moekit.engine.loader import load_engine
from moekit.model.compiled_step import SERVED_PREFILLS

SHAPES = ((1, 8, 0), (16, 8, 0), (1, 128, 1))  # rows, tokens, free slots after the prompt
ROUNDS = 9  # the first of each side is dropped


def prefill_ms(decoder, rows: int, tokens: int, room: int, compiled: bool, gen: torch.Generator) -> float:
    cache = decoder.new_cache(rows, tokens + room)
    ids = torch.randint(0, decoder.spec.vocab_size, (rows, tokens), generator=gen)
    positions = torch.arange(tokens)[None].expand(rows, tokens)
    start = time.perf_counter()
    with torch.inference_mode():
        (decoder if compiled else decoder.forward_modules)(ids, cache, positions, [], last_only=True)
    return (time.perf_counter() - start) * 1e3


def step_ms(decoder) -> float:
    cache = decoder.new_cache(1, 16)
    start = time.perf_counter()
    with torch.inference_mode():
        decoder.forward_rows(torch.zeros(1, 1, dtype=torch.int64), cache, torch.full((1,), 3), [])
    return (time.perf_counter() - start) * 1e3


def main(checkpoint: str, dtype: str = "float32", threads: int = 2) -> None:
    torch.set_num_threads(threads)
    decoder = load_engine(checkpoint, dtype=dtype).decoder
    seconds = decoder.compiled.warm_up((1,), prefills=SERVED_PREFILLS)
    print(f"warm-up {seconds:.1f} s ({decoder.compiled.loaded_graphs} graphs loaded from the cache)")
    gen = torch.Generator().manual_seed(0)
    for rows, tokens, room in SHAPES:
        eager, compiled = [], []
        for _ in range(ROUNDS):
            eager.append(prefill_ms(decoder, rows, tokens, room, False, gen))
            compiled.append(prefill_ms(decoder, rows, tokens, room, True, gen))
        e, c = statistics.median(eager[1:]), statistics.median(compiled[1:])
        fill = "roomy" if room else "full"
        print(f"{rows} × {tokens} tokens ({fill}): eager {e:.1f} ms, compiled {c:.1f} ms, eager ÷ compiled {e / c:.2f}×")
    print(f"one decode step, batch 1: {statistics.median([step_ms(decoder) for _ in range(15)][1:]):.1f} ms")


if __name__ == "__main__":
    main(*sys.argv[1:2], *sys.argv[2:3], *map(int, sys.argv[3:4]))
