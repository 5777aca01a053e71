"""Where a gpt-oss-20b decode step's bytes go, and how fast each part reads them: the machine's read
bandwidth at the step's thread count (the ceiling), then each product at its real shape, 1 row (a
lone token) and 4 rows (serving at c = 4), as time a step and GB/s of weight. Parts are measured one
after another in rounds (alternating) on one set of weights (~2.4 GB); the medians, and each part's share of the ceiling.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/gpt_oss_token_parts.py --rounds 3 --threads 2

The shape (gpt-oss-20b, 24 layers): D = 2880; attention's fused qkv [5120, 2880] and o [2880, 4096]
in bf16 (53 MB a layer); the router [32, 2880] bf16; 32 experts a layer, top-4, MXFP4 gate_up [5760,
2880] and down [2880, 2880] (13.2 MB an expert); lm_head [201088, 2880] bf16 (1.16 GB). Weights that
repeat across layers are held for LAYERS layers (more than the last-level cache) and cycled, so no
call finds its weight in the caches; a step's time is the part's calls for 24 layers.
"""

from __future__ import annotations

import argparse
import fcntl
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

from typing import Optional

import torch

from moekit import ops
from moekit.bench.bandwidth import product_read_bandwidth, threaded_read_bandwidth

D, QKV, O_IN, E, TOP, F2, VOCAB, LAYERS = 2880, 5120, 4096, 32, 4, 5760, 201088, 24
HELD = 8  # layers' weights held at once (8 x 53 MB of attention, 2 x 423 MB of experts)
BLOCK_BYTES = 17  # MXFP4: a scale byte and 16 bytes of codes per 32 weights
EXPERT_BYTES = (F2 + D) * (D // 32) * BLOCK_BYTES


def mxfp4_stack(rows: int, gen: torch.Generator) -> torch.Tensor:
    """[E, rows, D / 32 · 17] random codes, scale bytes 2^-7 .. 2^-3 (gpt-oss's range)."""
    w = torch.randint(0, 256, (E, rows, D // 32, BLOCK_BYTES), dtype=torch.uint8, generator=gen)
    w[..., 0] = torch.randint(120, 125, (E, rows, D // 32), dtype=torch.uint8, generator=gen)
    return w.view(E, rows, -1)


def bf16(*shape, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)


def picks(rows: int, distinct: bool, gen: torch.Generator, n: int = 64) -> list[torch.Tensor]:
    """n routings of `rows` rows, top-4 each: all 4 · rows experts distinct, or each row's own random 4."""
    if distinct:
        return [torch.randperm(E, generator=gen)[: TOP * rows].view(rows, TOP) for _ in range(n)]
    return [torch.stack([torch.randperm(E, generator=gen)[:TOP] for _ in range(rows)]) for _ in range(n)]


@dataclass
class Weights:
    """One set of weights for every part (~2.4 GB), each repeated part held for HELD layers."""

    lm_head: torch.Tensor
    qkv: list
    o: list
    router: list
    gate_up: list  # 2 stacks
    down: list

    @staticmethod
    def random(gen: torch.Generator) -> "Weights":
        return Weights(bf16(VOCAB, D, gen=gen), [bf16(QKV, D, gen=gen) for _ in range(HELD)],
                       [bf16(D, O_IN, gen=gen) for _ in range(HELD)], [bf16(E, D, gen=gen) for _ in range(HELD)],
                       [mxfp4_stack(F2, gen) for _ in range(2)], [mxfp4_stack(D, gen) for _ in range(2)])


def attention_part(w: Weights, rows: int, gen: torch.Generator):
    x, a = bf16(rows, D, gen=gen), bf16(rows, O_IN, gen=gen)

    def step():
        for layer in range(LAYERS):
            ops.rows_gemv(x, w.qkv[layer % HELD])
            ops.rows_gemv(a, w.o[layer % HELD])

    return step, LAYERS * (QKV * D + D * O_IN) * 2


def router_part(w: Weights, rows: int, gen: torch.Generator):
    x = bf16(rows, D, gen=gen)

    def step():
        for layer in range(LAYERS):
            ops.rows_gemv(x, w.router[layer % HELD])

    return step, LAYERS * E * D * 2


def lm_head_part(w: Weights, rows: int, gen: torch.Generator):
    x = bf16(rows, D, gen=gen)
    return (lambda: ops.rows_gemv(x, w.lm_head)), VOCAB * D * 2


def experts_part(w: Weights, rows: int, distinct: bool, gen: torch.Generator):
    """The compiled step's two calls a layer (ops.packed_experts, no bias), 24 layers over 2 held stacks."""
    routes = picks(rows, distinct, gen)
    x, h = bf16(rows, 1, D, gen=gen), bf16(rows, TOP, D, gen=gen)
    state = {"i": 0}
    # experts read in a step, on average over the routings
    chosen = LAYERS * statistics.mean(len(torch.unique(r)) for r in routes)

    def step():
        for layer in range(LAYERS):
            ids = routes[(state["i"] + layer) % len(routes)]
            ops.packed_experts(x, w.gate_up[layer % 2], ids, None, 0)
            ops.packed_experts(h, w.down[layer % 2], ids, None, 0)
        state["i"] += LAYERS

    return step, chosen * EXPERT_BYTES


def parts(rows: int) -> dict:
    """name → builder(weights, gen) → (step, bytes a step)."""
    table = {
        "lm_head bf16 [201088, 2880]": lambda w, g: lm_head_part(w, rows, g),
        "attention qkv + o bf16, 24 layers": lambda w, g: attention_part(w, rows, g),
        "router bf16 [32, 2880], 24 layers": lambda w, g: router_part(w, rows, g),
        "MXFP4 experts, 24 layers" + (" (4 each)" if rows == 1 else ", rows' own random 4"):
            lambda w, g: experts_part(w, rows, False, g),
    }
    if rows > 1:
        table[f"MXFP4 experts, 24 layers, {TOP * rows} distinct"] = lambda w, g: experts_part(w, rows, True, g)
    return table


def median_seconds(step, calls: int) -> float:
    step()  # fault pages in, wake the pool
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@contextmanager
def held(path: Optional[str]):
    """flock on path (shared machines take turns measuring), or nothing."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--lock", help="a file to hold flock on while measuring (not while making the weights)")
    args = parser.parse_args()
    loaded = ops.load()
    if not loaded.ok:
        raise SystemExit("; ".join(loaded.failures()))
    weights = Weights.random(torch.Generator().manual_seed(0))
    torch.set_num_threads(args.threads)
    with torch.inference_mode(), held(args.lock):
        sums, products = [], []
        for _ in range(args.rounds):
            sums.append(threaded_read_bandwidth(readings=3))
            products.append(product_read_bandwidth(readings=3))
        ceiling = max(statistics.median(sums), statistics.median(products))
        print(f"{args.threads} threads; read bandwidth (medians of {args.rounds}, each the best of 3): "
              f"torch sum {statistics.median(sums) / 1e9:.1f} GB/s, moekit fp32 rows_gemv {statistics.median(products) / 1e9:.1f} GB/s")
        for rows in map(int, args.rows.split(",")):
            table = parts(rows)
            runs = {name: [] for name in table}
            sizes = {}
            for r in range(args.rounds):
                for name, build in table.items():
                    step, nbytes = build(weights, torch.Generator().manual_seed(r))
                    sizes[name] = nbytes
                    runs[name].append(median_seconds(step, args.calls))
                    del step
            print(f"{rows} row(s), medians of {args.rounds} rounds of {args.calls} steps:")
            total_t = total_b = 0.0
            for name in table:
                t, nbytes = statistics.median(runs[name]), sizes[name]
                if "distinct" not in name:
                    total_t, total_b = total_t + t, total_b + nbytes
                print(f"  {name:48s} {t * 1e3:8.2f} ms  {nbytes / 1e9:6.3f} GB  {nbytes / t / 1e9:5.1f} GB/s  "
                      f"{nbytes / t / ceiling:4.0%} of the ceiling")
            print(f"  {'sum (a step without the attention scores and glue)':48s} {total_t * 1e3:8.2f} ms  {total_b / 1e9:6.3f} GB  "
                  f"{total_b / total_t / 1e9:5.1f} GB/s  -> {rows / total_t:.2f} tok/s at most")


if __name__ == "__main__":
    main()
