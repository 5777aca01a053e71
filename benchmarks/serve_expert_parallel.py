"""`moekit serve --expert-parallel`: throughput, bytes exchanged per token and memory per rank at
1 (the plain server), 2 and 4 ranks, with the simulator's bytes for the same configuration beside.

    .venv/bin/python benchmarks/make_checkpoints.py --sizes 150m --families qwen3_moe
    .venv/bin/python benchmarks/serve_expert_parallel.py bench-out/ckpt/qwen3_moe-150m --ranks 1,2,4

Each configuration is one real server on a free loopback port, sent the same random token-id
prompts (greedy, exactly --max-tokens each): concurrency 1 (requests one after another) then 16 at
once. Throughput is output tokens ÷ wall time of the phase, against the plain server measured in
the same run. Bytes per generated token come from /metrics (moekit:ep_sent_bytes_total, summed
over ranks, by kind), taken before and after each phase; the simulator (moekit.dist.simulate)
replays a uniform-random trace of the same shape (T tokens per forward, K, E, the even placement)
and predicts dispatch + combine only. Memory is each rank's resident set once loaded.

On a 2-core machine, ranks share two cores: this shows what the exchange costs, never a speed-up.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

MIB = 1 << 20


def start(checkpoint: str, ranks: int, threads: int, max_batch: int, compiled: bool = False):
    cmd = [sys.executable, "-m", "moekit", "serve", checkpoint, "--port", "0", "--max-batch", str(max_batch),
           "--threads", str(threads), "--prefix-cache-memory", "0"] + (["--compile"] if compiled else [])
    if ranks > 1:
        cmd += ["--expert-parallel", str(ranks), "--ep-timeout", "300"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found: dict = {}
    log: list = []

    def read() -> None:
        for line in proc.stderr:
            log.append(line.rstrip())
            m = re.search(r"^serving .* on (http://[\d.:]+)/v1", line)
            if m:
                found["url"] = m.group(1)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 600
    while "url" not in found:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"{ranks} ranks: the server did not start: {log[-5:]}")
        time.sleep(0.2)
    return proc, found["url"]


def metrics(url: str) -> dict:
    time.sleep(1.5)  # the server gathers its ranks' figures once a second
    out = {}
    for line in httpx.get(url + "/metrics", timeout=600).text.splitlines():
        if line.startswith("moekit:ep_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sent(m: dict) -> dict:
    kinds: dict = {}
    for name, value in m.items():
        g = re.match(r'moekit:ep_sent_bytes_total\{kind="(\w+)",rank="\d+"\}', name)
        if g:
            kinds[g.group(1)] = kinds.get(g.group(1), 0) + value
    return kinds


def rss_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def phase(url: str, prompts: list, max_tokens: int, concurrency: int) -> float:
    """→ output tokens per second of `prompts` sent `concurrency` at a time."""
    def ask(prompt) -> int:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
        return reply["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(ask, prompts))
    return tokens / (time.perf_counter() - started)


def simulated(checkpoint: str, ranks: int, tokens: int, forwards: int) -> float:
    """The simulator's dispatch + combine bytes per token at `tokens` per forward, even placement."""
    from moekit.dist.placement import linear_placement
    from moekit.dist.simulate import Cost, sim_report, simulate, uniform_forwards
    from moekit.spec import load_spec

    spec = load_spec(checkpoint)
    experts = {l: spec.layers[l].ffn.num_experts for l in spec.moe_layers}
    k = max(spec.layers[l].ffn.top_k for l in spec.moe_layers)
    fw = uniform_forwards(experts, k, tokens, forwards)
    placement = linear_placement(experts, ranks, {})
    return sim_report(fw, placement, simulate(fw, placement, Cost(row_bytes=spec.hidden_size * 4)),
                      Cost(row_bytes=spec.hidden_size * 4))["bytes_per_token"]


def memory_row(row: dict, proc, url: str, ranks: int) -> dict:
    """Resident memory per rank, and the weights each holds by kind (`moekit:ep_weight_bytes`, when
    the server reports it), after one request."""
    if ranks == 1:
        return {**row, "rss_per_rank": [rss_of(proc.pid)]}
    m = metrics(url)
    row["rss_per_rank"] = [v for k, v in sorted(m.items()) if k.startswith("moekit:ep_resident_memory")]
    for kind in ("dense", "experts"):
        row[f"{kind}_bytes_per_rank"] = [m[f'moekit:ep_weight_bytes{{kind="{kind}",rank="{r}"}}'] for r in range(ranks)
                                         if f'moekit:ep_weight_bytes{{kind="{kind}",rank="{r}"}}' in m]
    return row


def print_memory(rows: list) -> None:
    print("| ranks | resident memory per rank (MiB) | dense weights per rank (MiB) | routed experts per rank (MiB) |")
    print("|---|---|---|---|")
    for r in rows:
        cells = [", ".join(f"{v / MIB:.0f}" for v in r.get(k) or []) or "—"
                 for k in ("rss_per_rank", "dense_bytes_per_rank", "experts_bytes_per_rank")]
        print(f"| {r['ranks']} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--ranks", default="1,1t,2,4", help="1: the plain server on every core; 1t: on one thread; "
                        "a trailing c (2c): with --compile")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--sequential", type=int, default=4, help="requests of the concurrency-1 phase")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--memory-only", action="store_true",
                        help="each rank's resident memory and weights after one request; no throughput phases")
    parser.add_argument("--out", default="bench-out/serve_expert_parallel.json")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    rows: list = []
    for name in args.ranks.split(","):
        ranks = int(name.rstrip("tc"))
        threads = 1 if "t" in name else max(1, args.cores // ranks)
        proc, url = start(args.checkpoint, ranks, threads, 16, compiled="c" in name)
        try:
            phase(url, prompts[:1], 4, 1)  # warm-up
            row = {"ranks": ranks, "threads_per_rank": threads, "compiled": "c" in name}
            if args.memory_only:
                rows.append(memory_row(row, proc, url, ranks))
                print(json.dumps(rows[-1]), flush=True)
                continue
            before = sent(metrics(url)) if ranks > 1 else {}
            row["c1_tok_s"] = phase(url, prompts[: args.sequential], args.max_tokens, 1)
            middle = sent(metrics(url)) if ranks > 1 else {}
            row["c16_tok_s"] = phase(url, prompts, args.max_tokens, 16)
            after = metrics(url) if ranks > 1 else {}
            if ranks > 1:
                end = sent(after)
                row["c1_bytes_per_token"] = {k: (middle[k] - before[k]) / (args.sequential * args.max_tokens) for k in end}
                row["c16_bytes_per_token"] = {k: (end[k] - middle[k]) / (args.requests * args.max_tokens) for k in end}
                row["rss_per_rank"] = [v for k, v in sorted(after.items()) if k.startswith("moekit:ep_resident_memory")]
                row["sim_c1_bytes_per_token"] = simulated(args.checkpoint, ranks, 1, 64)
                row["sim_c16_bytes_per_token"] = simulated(args.checkpoint, ranks, 16, 64)
            else:
                row["rss_per_rank"] = [rss_of(proc.pid)]
        finally:
            proc.terminate()
            proc.wait(120)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.memory_only:
        print_memory(rows)
        return
    base = rows[0]
    print("| ranks | threads/rank | c=1 tok/s (× plain) | c=16 tok/s (× plain) | RSS per rank (MiB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        rss = ", ".join(f"{v / MIB:.0f}" for v in r["rss_per_rank"])
        print(f"| {r['ranks']}{' compiled' if r.get('compiled') else ''} | {r['threads_per_rank']} | {r['c1_tok_s']:.1f} ({r['c1_tok_s'] / base['c1_tok_s']:.2f}×) | "
              f"{r['c16_tok_s']:.1f} ({r['c16_tok_s'] / base['c16_tok_s']:.2f}×) | {rss} |")
    print()
    print("| ranks | c | bytes per generated token, all ranks: dispatch + combine (simulated) | all-gather | broadcast |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["ranks"] == 1:
            continue
        for c in ("c1", "c16"):
            b = r[f"{c}_bytes_per_token"]
            print(f"| {r['ranks']} | {c[1:]} | {b['dispatch'] + b['combine']:.0f} ({r[f'sim_{c}_bytes_per_token']:.0f}) | "
                  f"{b['all_gather']:.0f} | {b['broadcast']:.0f} |")


if __name__ == "__main__":
    main()
