"""The compiled decode step with one kind of weight's products forced onto each build of the operators
(AVX-512 against AVX2), in one process: four engines of one checkpoint placed A B B A
(benchmarks/abba.py), each compiled while moekit.ops.variant names its side's build for that kind.

moekit.ops.variant chooses the build by timing one row's products; a batch's products may be faster
on the other (benchmarks/fp32_blocks.py). This times the whole step at a batch, so the two can be
weighed where it matters. The builds sum a row's lanes in another order: the logits differ in the
last bits (printed), so this is a measurement, not a switch.

    PYTHONPATH=src .venv/bin/python benchmarks/step_builds_ab.py bench-out/ckpt/qwen3_moe-150m --batch 16
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from abba import PLACEMENT, abba_ms, timed_ms  # benchmarks/, on sys.path as the script's folder
from moekit import ops
from moekit.engine.loader import load_engine
from moekit.model.compiled_step import CompiledStep
from moekit.model.decoder import Decoder


def forced(kind: str, namespace: str):
    """moekit.ops.variant with `kind`'s build replaced by `namespace` (its grouping kept)."""
    chosen = ops.variant

    def variant(k: str) -> ops.Choice:
        return ops.Choice(namespace, chosen(k).grouped) if k == kind else chosen(k)

    return mock.patch.object(ops, "variant", variant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--dtype", default="float32", help="the weights' kind, whose build is forced")
    parser.add_argument("--a", default="moekit", help="the A side's build")
    parser.add_argument("--b", default="moekit_avx2", help="the B side's build")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=16, help="cache slots filled before the timed steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = ops.load()
    if not loaded.ok:
        raise SystemExit(loaded.failures()[0])
    print(f"{args.dtype} as chosen here: {ops.variant(args.dtype).label}; A {args.a}, B {args.b}")
    b, lo, hi = args.batch, args.context, args.context + args.steps
    tokens = torch.randint(0, 1000, (hi, b, 1), generator=torch.Generator().manual_seed(0))
    decoders, caches, logits = [], [], []
    with torch.inference_mode():
        for side in PLACEMENT:
            with mock.patch.object(Decoder, "compile_decode", lambda self, cpp_wrapper=True: None):
                decoder = load_engine(args.checkpoint, dtype=args.dtype, compile=True).decoder
            cache = decoder.new_cache(b, hi)
            with forced(args.dtype, args.a if side == "a" else args.b):
                decoder.compiled = CompiledStep(decoder, cache=None)  # traced now, with this side's build
                out = []
                for s in range(hi):  # compiles, fills the cache
                    slot = torch.full((b,), s)
                    out.append(decoder.compiled(tokens[s], cache, slot, slot, cache.key_mask[:, : s + 1]).logits)
            decoders.append(decoder), caches.append(cache), logits.append(out)
        diff = max((x - y).abs().max().item() for x, y in zip(logits[0], logits[1]))
        same = all(torch.equal(x, y) for x, y in zip(logits[0], logits[3]))
        print(f"largest logit difference A vs B: {diff:.3g}; A's two engines equal: {same}")

        def decode(i: int) -> None:
            dec, cache = decoders[i], caches[i]
            # Still forced: a step that goes through Dynamo re-checks the choice it traced with.
            with forced(args.dtype, args.a if PLACEMENT[i] == "a" else args.b):
                for s in range(lo, hi):
                    slot = torch.full((b,), s)
                    dec.compiled(tokens[s], cache, slot, slot, cache.key_mask[:, : s + 1])

        a, b_ms = abba_ms(lambda i: timed_ms(lambda: decode(i), args.steps), args.rounds)
    print(f"{args.checkpoint} {args.dtype} batch {b}, context {lo}, {args.threads} threads: A ({args.a}) {a:.3f} ms, "
          f"B ({args.b}) {b_ms:.3f} ms a step, A / B = {a / b_ms:.3f} (medians of {args.rounds} rounds of {args.steps} steps)")


if __name__ == "__main__":
    main()
