"""Serving throughput and latency: moekit serve against its peers (llama-server, vLLM) and static batching.

For each dtype, in one run and on the same random token-id prompts (greedy, exactly --max-tokens
output tokens per request, --threads for every side), the servers one at a time, their order
rotated each round (moekit.bench.serve_peers, what `moekit bench serve CKPT --vs ...` runs):
  - moekit serve (continuous batching, --max-batch 16), and each --moekit-variant (e.g. --compile);
  - llama-server (`-np 16`, the GGUF made by llama.cpp's own converter: f32, bf16, q8_0 for int8);
  - vLLM's CPU build (`--max-num-seqs 16`), when benchmarks/build_vllm_cpu.sh has built it;
  - static batching: `generate()` on batches of `concurrency` prompts, each batch run to the end
    before the next starts (what a server without continuous batching does at best), with --static.
Workload: c clients send 4 x c streamed completions of --prompt-len-token prompts at c = 1, 4, 16,
then c = 16 again with --arrivals prompts of --arrival-tokens ids arriving during it.

  benchmarks/build_llama_cpp.sh; benchmarks/build_vllm_cpu.sh                 # once
  .venv/bin/python benchmarks/serve_bench.py bench-out/ckpt/qwen3_moe-150m --dtypes float32,bfloat16 \
      --vs llama-server,vllm --moekit-variant=--compile --json bench-out/serve-150m.json
  .venv/bin/python benchmarks/serve_bench.py bench-out/ckpt/qwen3_moe-150m --dtypes float32 --weights int8 --vs llama-server
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from moekit.bench.serve import load_prompts, percentiles
from moekit.bench.serve_peers import ServeSetup, Workload, markdown_table, parse_vs, ratio_rows, run_peers
from moekit.bench.server_launch import free_port, stop, wait_ready  # noqa: F401 - logprobs_cost, prefix_cache_ttft

def static_batching(checkpoint: Path, dtype: str, prompts, args) -> list[dict]:
    """generate() on fixed batches: a batch starts when the previous one has finished entirely."""
    import torch

    from moekit.engine.loader import load_engine

    torch.set_num_threads(args.threads)
    engine = load_engine(checkpoint, dtype=dtype, compile=False)
    engine.generate([prompts[0]], max_new_tokens=4, stop_ids=())  # warm-up
    out = []
    for c in args.concurrency:
        requests = max(args.requests, c)
        started = time.perf_counter()
        e2e, tokens = [], 0
        for begin in range(0, requests, c):
            batch = [prompts[(begin + i) % len(prompts)] for i in range(min(c, requests - begin))]
            t0 = time.perf_counter()
            gen = engine.generate(batch, max_new_tokens=args.max_tokens, stop_ids=(), record_routing=False)
            e2e += [time.perf_counter() - t0] * len(batch)  # a row's reply comes when its batch ends
            tokens += sum(len(t) for t in gen.token_ids)
        wall = time.perf_counter() - started
        step = gen.timing.decode_s / max(gen.timing.decode_steps, 1)
        out.append({"concurrency": c, "requests": requests, "output_tokens": tokens, "wall_s": wall,
                    "output_tok_s": tokens / wall, "e2e_s": percentiles(e2e), "decode_step_s": step})
        print(f"  c={c:<3} {tokens / wall:8.1f} tok/s  (static batches of {c})", flush=True)
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--weights", default="dtype", help="moekit's --weights (int8: llama-server on q8_0)")
    parser.add_argument("--vs", default="llama-server", help="baselines: llama-server, vllm, moekit:FLAGS")
    parser.add_argument("--moekit-variant", action="append", default=[],
                        help="more moekit serve flags to compare as another engine, e.g. --moekit-variant=--compile")
    parser.add_argument("--moekit-args", default="", help="flags of the subject moekit serve")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--arrivals", type=int, default=4, help="long prompts arriving during the last level (0: none)")
    parser.add_argument("--arrival-tokens", type=int, default=512)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--static", action="store_true", help="also static batching with generate()")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.requests = 4 * max(args.concurrency)
    vs = ",".join([args.vs, *(f"moekit:{flags}" for flags in args.moekit_variant)])
    workload = Workload(prompt_len=args.prompt_len, max_tokens=args.max_tokens, concurrency=tuple(args.concurrency),
                        arrival_prompt_len=args.arrival_tokens, arrival_count=args.arrivals,
                        arrival_concurrency=max(args.concurrency))
    report = {"checkpoint": str(args.checkpoint), "threads": args.threads, "weights": args.weights,
              "workload": asdict(workload), "max_batch": args.max_batch, "runs": {}}
    for dtype in args.dtypes.split(","):
        setup = ServeSetup(args.checkpoint, dtype, args.weights, args.threads, args.max_batch)
        rounds = run_peers(parse_vs(vs, args.moekit_args), setup, workload, args.rounds, progress=lambda line: print(line, flush=True))
        report["runs"][dtype] = {"rounds": [{k: v.as_dict() for k, v in r.items()} for r in rounds]}
        print(f"\n{dtype}, weights {args.weights}: output tok/s (TTFT p50 ms, ITL p50/p99 ms)\n"
              f"{markdown_table(ratio_rows(rounds))}\n", flush=True)
        if args.static:
            vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
            prompts = load_prompts(None, args.prompt_len, vocab, args.requests, seed=0)
            report["runs"][dtype]["static"] = static_batching(args.checkpoint, dtype, prompts, args)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
