"""How fast moekit::experts_mxfp4 reads its weight at gpt-oss-20b's decode shape, against the bf16
rows kernel (moekit::rows_gemv) reading the same number of bytes: GB/s of weight read, one token
(batch 1), 1 and 2 threads, the forms alternated round by round in one process so that a noisy
neighbour slows all alike; the ratio is each form's median over rows_gemv's.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/mxfp4_bandwidth.py --rounds 5

The shape (gpt-oss-20b): E = 32 experts, top-4, D = 2880; gate_up [5760, 2880] and down [2880, 2880],
MXFP4 (17 bytes a 32-weight block: 4 experts' gate_up 35.2 MB, down 17.6 MB a token). Each call
picks 4 other experts (random, seeded) so that no call finds its weight in the caches. x is fp32
(an fp32 model's activations) or bf16 (gpt-oss runs bf16: the operator's bf16 pair product).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moekit import ops

E, TOP, D, F2 = 32, 4, 2880, 5760  # experts, chosen a token, hidden, gate_up rows
BLOCK_BYTES = 17  # an E8M0 scale byte and 16 bytes of FP4 codes, per 32 weights


def mxfp4_stack(rows: int, gen: torch.Generator) -> torch.Tensor:
    """[E, rows, D / 32 · 17] random codes, each block's scale byte 2^-7 .. 2^-3 (gpt-oss's range)."""
    w = torch.randint(0, 256, (E, rows, D // 32, BLOCK_BYTES), dtype=torch.uint8, generator=gen)
    w[..., 0] = torch.randint(120, 125, (E, rows, D // 32), dtype=torch.uint8, generator=gen)
    return w.view(E, rows, -1)


def seconds(call, calls: int) -> float:
    """Median seconds of one call over `calls` calls (after one warm-up)."""
    call(0)
    times = []
    for i in range(calls):
        t = time.perf_counter()
        call(i + 1)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def forms(x_dtypes: list[str], gen: torch.Generator) -> dict:
    """name → (call(i), bytes of weight a call reads)."""
    gate_up, down = mxfp4_stack(F2, gen), mxfp4_stack(D, gen)
    picks = [torch.randperm(E, generator=gen)[:TOP].view(1, TOP) for _ in range(64)]
    expert_bytes = TOP * (F2 + D) * (D // 32) * BLOCK_BYTES
    run = ops.op("moekit", "experts_mxfp4")
    table = {}
    for name in x_dtypes:
        dtype = getattr(torch, name)
        x, h = torch.randn(1, 1, D).to(dtype), torch.randn(1, TOP, F2 // 2).to(dtype)  # down's input: F2 / 2 = D

        def call(i, x=x, h=h):
            ids = picks[i % len(picks)]
            run(x, gate_up, ids)
            run(h, down, ids)

        table[f"experts_mxfp4 x {name}"] = (call, expert_bytes)
    # the same bytes as bf16 rows [N, D] in 4 matrices (no cache holds them across calls)
    rows = expert_bytes // (2 * D)
    mats = [torch.randn(rows // 4, D, generator=gen).to(torch.bfloat16) for _ in range(8)]
    xb = torch.randn(1, D).to(torch.bfloat16)

    def gemv(i):
        for k in range(4):
            ops.rows_gemv(xb, mats[(4 * i + k) % len(mats)])

    table["rows_gemv bf16 (same bytes)"] = (gemv, 4 * (rows // 4) * D * 2)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--x", default="float32,bfloat16", help="x dtypes of the experts' product")
    args = parser.parse_args()
    loaded = ops.load()
    if not loaded.ok:
        raise SystemExit("; ".join(loaded.failures()))
    table = forms(args.x.split(","), torch.Generator().manual_seed(0))
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        runs = {name: [] for name in table}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name, (call, _) in table.items():
                    runs[name].append(seconds(call, args.calls))
        base_name = "rows_gemv bf16 (same bytes)"
        base = table[base_name][1] / statistics.median(runs[base_name])  # bytes a second
        print(f"{threads} thread(s), {args.rounds} rounds of {args.calls} calls, medians:")
        for name, (_, nbytes) in table.items():
            t = statistics.median(runs[name])
            print(f"  {name:30s} {t * 1e3:7.2f} ms  {nbytes / t / 1e9:6.1f} GB/s  {nbytes / t / base:5.2f}x rows_gemv's GB/s")


if __name__ == "__main__":
    main()
