"""TTFT with and without automatic prefix caching on a shared-prefix load.

Every request is one shared prefix of --prefix-tokens random ids followed by its own suffix of
--suffix-tokens ids (a few-shot prompt or a long system prompt with short questions). One run
starts `moekit serve` twice on the same checkpoint, with `--prefix-cache-memory 0` (off) and with
the default budget (on), sends each the same requests at each concurrency and prints the TTFT of
both and their ratio, plus the share of prompt tokens the cache served. Before each level one
request with a suffix of its own fills the cache (and warms the server), as a first user would.

  .venv/bin/python benchmarks/prefix_cache_ttft.py                              # the bundled model
  .venv/bin/python benchmarks/prefix_cache_ttft.py bench-out/ckpt/qwen3_moe-150m --vocab 4096
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from serve_bench import free_port, stop, wait_ready

from moekit.bench.serve import LoadPlan, run_level
from moekit.engine.default_model import bundled_model_path


def shared_prefix_prompts(prefix: int, suffix: int, count: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts: one prefix of `prefix` random ids, then `suffix` random ids of each one's own."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [shared + [rng.randrange(3, vocab) for _ in range(suffix)] for _ in range(count)]


def measure(checkpoint: Path, cache: str, levels: list[int], prompts: list[list[int]], args) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moekit", "serve", str(checkpoint), "--port", str(port), "--threads", str(args.threads),
           "--max-batch", str(max(levels)), "--prefix-cache-memory", cache]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = []
    try:
        wait_ready(url, proc)
        for i, c in enumerate(levels):
            # Prompts of this level only: each suffix is new to the server, only the prefix repeats.
            level_prompts = prompts[1 + i * args.requests : 1 + (i + 1) * args.requests]
            run_level(LoadPlan(url=url, prompts=[prompts[0]], max_tokens=args.max_tokens), 1, concurrency=1)
            level = run_level(LoadPlan(url=url, prompts=level_prompts, max_tokens=args.max_tokens), args.requests,
                              concurrency=c)
            out.append({"concurrency": c, "errors": level.errors, "ttft_s": level.ttft_s, "e2e_s": level.e2e_s})
        metrics = {line.split()[0]: float(line.split()[1]) for line in _get(url + "/metrics").splitlines()
                   if line.startswith("moekit:prefix_cache")}
        for row in out:
            row["prefix_cache"] = metrics
    finally:
        stop(proc)
    return out


def _get(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=30).text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, default=bundled_model_path())
    parser.add_argument("--prefix-tokens", type=int, default=400)
    parser.add_argument("--suffix-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4, help="Output tokens per request (TTFT is the point).")
    parser.add_argument("--requests", type=int, default=16, help="Requests per concurrency level.")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=None, help="Ids drawn below this (default: the config's vocab).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    vocab = args.vocab or json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    prompts = shared_prefix_prompts(args.prefix_tokens, args.suffix_tokens, 1 + args.requests * len(levels), vocab,
                                    args.seed)
    print(f"{args.checkpoint.name}: prefix {args.prefix_tokens} + suffix {args.suffix_tokens} tokens, "
          f"{args.max_tokens} out, {args.requests} requests per level, {args.threads} threads", flush=True)
    off = measure(args.checkpoint, "0", levels, prompts, args)
    on = measure(args.checkpoint, "1GiB", levels, prompts, args)
    hits = on[0]["prefix_cache"]
    share = hits.get("moekit:prefix_cache_hits_total", 0) / max(hits.get("moekit:prefix_cache_queries_total", 1), 1)
    print(f"{'c':>3} {'TTFT p50 off':>13} {'on':>9} {'off/on':>7} {'p90 off':>9} {'on':>9} {'errors':>7}")
    for a, b in zip(off, on):
        print(f"{a['concurrency']:>3} {a['ttft_s']['p50'] * 1e3:>10.1f} ms {b['ttft_s']['p50'] * 1e3:>6.1f} ms "
              f"{a['ttft_s']['p50'] / b['ttft_s']['p50']:>6.2f}× {a['ttft_s']['p90'] * 1e3:>6.1f} ms "
              f"{b['ttft_s']['p90'] * 1e3:>6.1f} ms {a['errors'] + b['errors']:>7}")
    print(f"prompt tokens served from the cache (on): {share:.1%}")
    if args.json is not None:
        args.json.write_text(json.dumps({"checkpoint": str(args.checkpoint), "off": off, "on": on}, indent=1))


if __name__ == "__main__":
    main()
