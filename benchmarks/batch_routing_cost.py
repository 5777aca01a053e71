"""What routing a decode step's rows as one batch costs: one MoE layer's routing of B rows' router
logits (the bundled model's first router on token embeddings), exact (`route`) against a batch-level policy run shared by the B rows (what
`moekit serve` does since issue 39's item 2) and against B runs of one row each (what it did
before). Times are medians of --repeat rounds of --calls calls, in one process, one torch thread;
the ratios are against exact routing measured in the same run.

  .venv/bin/python benchmarks/batch_routing_cost.py                  # the bundled model, B = 16
  .venv/bin/python benchmarks/batch_routing_cost.py --rows 8 --policies capacity:1:drop
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moekit.engine.default_model import bundled_model_path
from moekit.engine.loader import load_engine
from moekit.engine.row_routing import RowRouting
from moekit.model.routing import PolicyRun, parse_policy, route


def per_call_us(fn, calls: int, repeat: int) -> float:
    for _ in range(calls // 10 + 1):
        fn()
    rounds = []
    for _ in range(repeat):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--policies", default="capacity:1:drop,capacity:1.25:reroute,loadaware:0.8")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = load_engine(bundled_model_path(), compile=False)
    layer = next(b.ffn for b in engine.decoder.layers if hasattr(b.ffn, "router"))
    spec, experts = layer.router.spec, layer.router.spec.num_experts
    k = spec.top_k
    prompts = [[1 + (37 * r + 11 * t) % 4000 for t in range(8)] for r in range(args.rows)]
    with torch.inference_mode():  # the first MoE router on each row's last token embedding: real logits' spread
        x = torch.stack([engine.decoder.embed(torch.tensor(p))[-1] for p in prompts])  # [B, D]
        logits = layer.router.logits(x)  # [B, E]
    exact = per_call_us(lambda: route(logits, spec, None), args.calls, args.repeat)
    print(f"B = {args.rows} rows, E = {experts}, K = {k}: exact routing {exact:.0f} us per layer")
    for text in args.policies.split(","):
        policy = parse_policy(text, k, experts)
        shared = RowRouting([PolicyRun(policy, 1)] * args.rows, [k] * args.rows).at(0)
        alone = RowRouting([PolicyRun(policy, 1) for _ in range(args.rows)], [k] * args.rows).at(0)
        batch = per_call_us(lambda: shared.route(logits, spec, None, x), args.calls, args.repeat)
        rows = per_call_us(lambda: alone.route(logits, spec, None, x), args.calls, args.repeat)
        print(f"{text:>22}: as one batch {batch:7.0f} us ({batch / exact:5.1f}x exact)   "
              f"row by row {rows:7.0f} us ({rows / exact:5.1f}x exact; batch/row-by-row {batch / rows:.2f})")


if __name__ == "__main__":
    main()
