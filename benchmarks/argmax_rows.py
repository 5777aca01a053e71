"""Greedy decoding's token: moekit::rows_argmax (each build of moekit.ops) against
torch.argmax on the same fp32 logits, alternating in one process; checks they agree first.

    .venv/bin/python benchmarks/argmax_rows.py --vocab 32000 --batch 1,8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moekit import ops


def per_call_us(fn, x: torch.Tensor, calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = ops.load()
    if not loaded.ok:
        raise SystemExit(loaded.failures()[0])
    sides = {"torch.argmax": lambda x: x.argmax(dim=-1)}
    sides.update({f"{space}::rows_argmax": ops.op(space, "rows_argmax") for space in ops.namespaces()})
    for b in (int(v) for v in args.batch.split(",")):
        x = torch.randn(b, args.vocab, generator=torch.Generator().manual_seed(b))
        want = x.argmax(dim=-1)
        assert all(torch.equal(fn(x), want) for fn in sides.values()), "a side disagrees with torch.argmax"
        times = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, fn in sides.items():
                times[name].append(per_call_us(fn, x, args.calls))
        base = statistics.median(times["torch.argmax"])
        line = ", ".join(f"{name} {statistics.median(t):.2f} µs ({base / statistics.median(t):.1f}x)" for name, t in times.items())
        print(f"batch {b}, vocab {args.vocab}, {args.threads} threads: {line}")


if __name__ == "__main__":
    main()
