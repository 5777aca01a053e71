"""What logprobs cost a server's throughput: the same requests with and without `logprobs`, against
one `moekit serve` process, levels alternated (ABAB…) so that a machine's drift hits both sides.

Every request streams exactly --max-tokens tokens (greedy, ignore_eos); "with" asks `logprobs: N`
(each token's logprob and its N most likely alternatives). Prints output tokens/s of each round and
the with/without ratio per concurrency (median over rounds). `--engine` measures the scheduler
alone, in this process (no HTTP): a batch of --requests rows, --max-tokens each, with and without.

  .venv/bin/python benchmarks/logprobs_cost.py                      # the bundled model
  .venv/bin/python benchmarks/logprobs_cost.py CKPT --concurrency 1,8 --rounds 3 --top 5
  .venv/bin/python benchmarks/logprobs_cost.py --engine --requests 8 --max-tokens 32 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from serve_bench import free_port, stop, wait_ready

from moekit.bench.serve import LoadPlan, load_prompts, run_level


def engine_rounds(args) -> None:
    """The scheduler alone: the same batch with and without logprobs, alternated."""
    import torch

    from moekit.engine.default_model import bundled_model_path
    from moekit.engine.loader import load_engine
    from moekit.engine.scheduler import Request, Scheduler, generate_batch

    torch.set_num_threads(args.threads)
    engine = load_engine(args.checkpoint or bundled_model_path(), compile=False)
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(16)] for i in range(args.requests)]
    seen: dict[str, list[float]] = {"without": [], "with": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for side, top in (("without", None), ("with", args.top)):
            scheduler = Scheduler(engine.decoder, max_batch=args.requests)
            requests = [Request(prompt=p, max_new_tokens=args.max_tokens, logprobs=top) for p in prompts]
            started = time.perf_counter()
            generate_batch(scheduler, requests)
            tok_s = args.requests * args.max_tokens / (time.perf_counter() - started)
            if r:
                seen[side].append(tok_s)
                print(f"engine round {r} {side:>7} logprobs: {tok_s:7.1f} tok/s", flush=True)
    ratio = statistics.median(w / o for w, o in zip(seen["with"], seen["without"]))
    print(f"engine, batch {args.requests}: with/without logprobs={args.top} = {ratio:.3f} (median of {args.rounds} rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=5, help="logprobs: N on the 'with' side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", action="store_true", help="the scheduler in this process, no server")
    args = parser.parse_args()
    if args.engine:
        return engine_rounds(args)

    port = free_port()
    cmd = [sys.executable, "-m", "moekit", "serve", *([args.checkpoint] if args.checkpoint else []), "--host", "127.0.0.1",
           "--port", str(port), "--threads", str(args.threads), "--max-batch", "16"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        prompts = load_prompts(None, 16, 1000, args.requests, seed=0)
        plans = {"without": LoadPlan(url=url, prompts=prompts, max_tokens=args.max_tokens),
                 "with": LoadPlan(url=url, prompts=prompts, max_tokens=args.max_tokens, extra={"logprobs": args.top})}
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            seen: dict[str, list[float]] = {"without": [], "with": []}
            for r in range(args.rounds):
                for side, plan in plans.items():
                    level = run_level(plan, args.requests, concurrency=concurrency, warmup=1 if r == 0 else 0)
                    if level.errors:
                        raise SystemExit(f"{side}: {level.errors} errors: {level.first_error}")
                    seen[side].append(level.output_tok_s)
                    print(f"c={concurrency} round {r} {side:>7} logprobs: {level.output_tok_s:7.1f} tok/s", flush=True)
            ratio = statistics.median(w / o for w, o in zip(seen["with"], seen["without"]))
            print(f"c={concurrency}: with/without logprobs={args.top} = {ratio:.3f} (median of {args.rounds} rounds)", flush=True)
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
