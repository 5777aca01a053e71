"""The compiled decode step with its weights in 2 MB pages (what load_engine does) against the same
weights in 4 KB pages, in one process: four engines of one checkpoint placed huge, 4 KB, 4 KB, huge
(benchmarks/abba.py).

    .venv/bin/python benchmarks/huge_pages_ab.py bench-out/ckpt/qwen3_moe-150m --dtype float32
"""

from __future__ import annotations

import argparse
import mmap

import torch

from abba import PLACEMENT, abba_ms, timed_ms  # benchmarks/, on sys.path as the script's folder
from moekit.engine.loader import load_engine
from moekit.model.huge_pages import move_to_huge_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="dtype")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = []
    for side in PLACEMENT:  # A: 2 MB pages, B: 4 KB pages
        engine = load_engine(args.checkpoint, dtype=args.dtype, weights=args.weights, compile=True)
        if side == "b":  # load_engine advised huge pages; copy the weights back into 4 KB pages
            move_to_huge_pages(engine.decoder, advice=mmap.MADV_NOHUGEPAGE)
        engines.append(engine.decoder)
    span = args.steps + 16
    caches = [d.new_cache(1, span) for d in engines]
    tokens = torch.randint(0, 1000, (span, 1, 1), generator=torch.Generator().manual_seed(0))

    def decode(i: int, lo: int, hi: int) -> list[torch.Tensor]:
        out = []
        caches[i].length = lo  # each round rewrites the same slots
        for s in range(lo, hi):
            out.append(engines[i](tokens[s], caches[i], torch.tensor([[s]])))
        return out

    with torch.inference_mode():
        first = [decode(i, 0, 16) for i in range(4)]  # compiles, fills the caches' first 16 slots
        assert all(torch.equal(a, b) for row in first[1:] for a, b in zip(row, first[0])), "the copies disagree"
        huge, small = abba_ms(lambda i: timed_ms(lambda: decode(i, 16, span), args.steps), args.rounds)
    print(f"{args.checkpoint} {args.dtype} weights={args.weights}, {args.threads} threads: "
          f"2 MB pages {huge:.3f} ms a step, 4 KB pages {small:.3f} ms; 4 KB / 2 MB = {small / huge:.3f} "
          f"(medians of {args.rounds} rounds of {args.steps} steps)")


if __name__ == "__main__":
    main()
