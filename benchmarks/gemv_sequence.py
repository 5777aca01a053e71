"""The products of one decode step of the ~140M qwen3_moe shape (8 layers: qkv, o and router
projections, gate_up and down of each row's 4 experts out of 32, then the 32000 × 512 head), on
distinct weights per layer so that they stream from memory as in a real step, timed for the
moekit::rows_gemv / experts_gemv operators of src/moekit/ops/csrc, optionally against the same
operators built from another version of that folder, alternating in one process.

    .venv/bin/python benchmarks/gemv_sequence.py --dtype bfloat16 --batch 8
    git worktree add /tmp/before COMMIT
    .venv/bin/python benchmarks/gemv_sequence.py --dtype bfloat16 --batch 8 --against /tmp/before/src/moekit/ops/csrc

--dtype q8_0 times moekit::rows_q8 / experts_q8 on the same shapes quantized to q8_0 blocks (x fp32).
With --against, it also says whether both versions' outputs are equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from moekit.ops import build as builds
from moekit.ops.q8_0 import quantize_q8_0

LAYERS, D, F, E, K, V = 8, 512, 256, 32, 4, 32000


def build(tag: str, csrc: Path):
    """The operators of the sources in csrc, built natively and registered under the namespace `tag`
    with their plain names (moekit.ops.build's defines, not an edit of the sources)."""
    result = builds.build(builds.Variant(tag, "", ("-march=native",)), csrc=csrc)
    if not result.ok:
        raise SystemExit(result.line())
    return getattr(torch.ops, tag)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "q8_0"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--against", type=Path, help="another version's src/moekit/ops/csrc to time beside this one")
    parser.add_argument("--grouped", action="store_true",
                        help="this tree's operators with their weight rows in groups (older versions have no choice)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = {"this": build("gemv_this", builds.CSRC)}
    if args.against:
        variants["against"] = build("gemv_against", args.against)
    q8, b = args.dtype == "q8_0", args.batch
    dt = torch.float32 if q8 else getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        w = torch.randn(*shape, generator=gen)
        return quantize_q8_0(w.reshape(-1, shape[-1])).reshape(*shape[:-1], -1) if q8 else w.to(dt)

    layers = [[weight(n, D) for n in (1536, 512, E)] + [weight(E, 2 * F, D), weight(E, D, F)] for _ in range(LAYERS)]
    head = weight(V, D)
    x, h = torch.randn(b, D, generator=gen).to(dt), torch.randn(b, K, F, generator=gen).to(dt)
    ids = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(b)]) for _ in range(64)]

    def products(ops):
        return (ops.rows_q8, ops.experts_q8) if q8 else (ops.rows_gemv, ops.experts_gemv)

    def step(ops, i: int) -> None:
        extra = (True,) if args.grouped and ops is variants["this"] else ()
        rows, experts = products(ops)
        for j, (qkv, o, router, gate_up, down) in enumerate(layers):
            chosen = ids[(i * LAYERS + j) % len(ids)]
            rows(x, qkv, *extra), rows(x, o, *extra), rows(x, router, *extra)
            experts(x[:, None], gate_up, chosen, *extra), experts(h, down, chosen, *extra)
        rows(x, head, *extra)

    if args.against:  # the same floats? the head and one layer's down projection, both versions
        outs = [(products(ops)[0](x, head), products(ops)[1](h, layers[0][4], ids[0])) for ops in variants.values()]
        print("outputs equal:", all(torch.equal(a, c) for a, c in zip(*outs)))

    # The bytes a step reads: every dense weight, and per layer the union of its rows' chosen experts.
    dense = sum(w.nbytes for layer in layers for w in layer[:3]) + head.nbytes
    expert = (layers[0][3][0].nbytes + layers[0][4][0].nbytes)
    union = statistics.mean(len(set(ids[(i * LAYERS + j) % len(ids)].flatten().tolist()))
                            for i in range(5) for j in range(LAYERS))
    step_bytes = dense + LAYERS * union * expert
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, ops in variants.items():
            step(ops, 0)
            began = time.perf_counter()
            for i in range(5):
                step(ops, i)
            times[name].append((time.perf_counter() - began) / 5)
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"{name:8s} {args.dtype} batch {b}: {ms:.2f} ms a step's products, {step_bytes / ms / 1e6:.1f} GB/s of "
              f"its {step_bytes / 1e6:.0f} MB ({union:.1f} experts a layer; median of {args.rounds}, {args.threads} threads)")


if __name__ == "__main__":
    main()
