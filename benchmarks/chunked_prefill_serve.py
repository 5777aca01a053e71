"""Chunked prefill under load: TTFT and ITL at one concurrency while long prompts arrive, per prefill budget.

One run starts `moekit serve` once per --max-prefill-tokens value (a value of at least the long
prompt's length is whole prefill: the "before"), alternating the values over --rounds, and sends
each the same closed-loop load: --concurrency clients, streamed greedy completions of --max-tokens
tokens, every --long-every-th request a prompt of --long-len random ids, the others --short-len.
Printed per server: output tok/s, TTFT p50/p99 and ITL p50/p99 over every request.

  PYTHONPATH=src .venv/bin/python benchmarks/chunked_prefill_serve.py bench-out/ckpt/qwen3_moe-150m \
      --budgets 4096,128 --concurrency 16 --requests 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from serve_bench import free_port, stop, wait_ready

from moekit.bench.serve import LoadPlan, run_level
from moekit.weights.gguf_spec import load_any_spec


def mixed_prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(args.long_len if i % args.long_every == args.long_every - 1
                                                        else args.short_len)]
            for i in range(args.requests)]


def measure(checkpoint: Path, budget: int, prompts, args) -> dict:
    import subprocess

    port = free_port()
    cmd = [sys.executable, "-m", "moekit", "serve", str(checkpoint), "--port", str(port), "--dtype", args.dtype,
           "--max-batch", str(args.concurrency), "--threads", str(args.threads), "--max-prefill-tokens", str(budget),
           "--prefix-cache-memory", "0", *args.serve_arg]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout_s=600)
        plan = LoadPlan(url=f"http://127.0.0.1:{port}", prompts=prompts, max_tokens=args.max_tokens)
        level = run_level(plan, len(prompts), concurrency=args.concurrency, warmup=2)
    finally:
        stop(proc)
    return {"max_prefill_tokens": budget, "output_tok_s": level.output_tok_s, "errors": level.errors,
            "ttft_ms": {k: v * 1e3 for k, v in level.ttft_s.items()}, "itl_ms": {k: v * 1e3 for k, v in level.itl_s.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--budgets", default="4096,128", help="--max-prefill-tokens values, comma-separated")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--short-len", type=int, default=8)
    parser.add_argument("--long-len", type=int, default=512)
    parser.add_argument("--long-every", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to every moekit serve (repeatable)")
    args = parser.parse_args()
    prompts = mixed_prompts(args, load_any_spec(args.checkpoint).vocab_size)
    for r in range(args.rounds):
        for budget in [int(b) for b in args.budgets.split(",")]:
            row = measure(args.checkpoint, budget, prompts, args)
            print(json.dumps({"round": r, **row}), flush=True)


if __name__ == "__main__":
    main()
