"""What the scheduler adds to a decode step at c = 1: one lone greedy row stepped by the Scheduler (as
`moekit serve` steps it, callbacks aside) against the same compiled step called bare, as
generate's loop calls it (Decoder.forward_rows, then the argmax), on one loaded engine.

Counts first, since they do not depend on the machine's load: Python function calls per token
(sys.setprofile's "call" and "c_call" events) inside forward_rows and outside it. Then each
scheduler phase's CPU time per call on this thread (time.thread_time: a preempted thread's wait
is not counted) and wall time, and the ms per token of both loops, alternated over --rounds.
Both loops must give the same tokens (checked).

  PYTHONPATH=src .venv/bin/python benchmarks/served_step_cost.py bench-out/ckpt/qwen3_moe-150m \\
      --dtype bfloat16 --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from moekit.engine.loader import load_engine
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.model.cache import copy_row

PHASES = ("step", "_admit", "_release", "_decode", "_meter_step", "_advance", "_sample")


def timed(obj, name: str, spent: dict) -> None:
    """Wrap obj.name so that each call adds [CPU ns, wall ns, 1] to spent[name]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = spent[name]
            entry[0] += time.thread_time_ns() - cpu
            entry[1] += time.perf_counter_ns() - wall
            entry[2] += 1

    setattr(obj, name, wrapper)


def call_counts(fn, forward_code) -> Counter:
    """Python and C calls made while fn runs, split by whether forward_rows is on the stack."""
    counts: Counter = Counter()
    depth = [0]

    def profile(frame, event, arg):
        if event == "call":
            if frame.f_code is forward_code:
                depth[0] += 1
            counts["forward" if depth[0] else "outside"] += 1
        elif event == "return" and frame.f_code is forward_code:
            depth[0] -= 1
        elif event == "c_call":
            counts["forward C" if depth[0] else "outside C"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    engine = load_engine(args.checkpoint, dtype=args.dtype)
    decoder = engine.decoder
    if decoder.compiled is not None:
        decoder.compiled.warm_up((1, 2), rows=16)
    prompt, new = list(range(3, 11)), args.tokens
    scheduler = Scheduler(decoder, max_batch=16, max_len=len(prompt) + new, bytes_per_param=engine.bytes_per_param,
                          expert_bytes=engine.expert_bytes, dense_saving=engine.dense_saving)

    def served() -> list[int]:
        tokens: list[int] = []
        generate_batch(scheduler, [Request(prompt=prompt, max_new_tokens=new, on_token=tokens.append)])
        return tokens

    def bare() -> list[int]:
        cache = decoder.new_cache(16, len(prompt) + new)
        with torch.inference_mode():
            single = decoder.new_cache(1, len(prompt))
            logits = decoder(torch.tensor([prompt]), single, torch.arange(len(prompt))[None], [], last_only=True)
            copy_row(cache, 0, single, 0, len(prompt))
            token, length = int(logits[0, -1].argmax()), len(prompt)
            tokens = [token]
            for _ in range(new - 1):
                logits = decoder.forward_rows(torch.tensor([[token]]), cache, torch.tensor([length]), [])
                length += 1
                token = int(logits[0, -1].argmax())
                tokens.append(token)
        return tokens

    if served() != bare():
        raise SystemExit("the served and the bare loop gave different tokens")
    forward_code = type(decoder).forward_rows.__code__
    for name, fn in (("served", served), ("bare", bare)):
        counts = call_counts(fn, forward_code)
        print(f"{name}: Python calls per token " + ", ".join(f"{k} {v / new:.1f}" for k, v in sorted(counts.items())))

    spent: dict = defaultdict(lambda: [0, 0, 0])
    for name in PHASES:
        timed(scheduler, name, spent)
    per_token = {"served": [], "bare": []}
    for r in range(args.rounds):
        for name, fn in (("served", served), ("bare", bare)) if r % 2 == 0 else (("bare", bare), ("served", served)):
            start = time.perf_counter()
            fn()
            per_token[name].append((time.perf_counter() - start) / new * 1e3)
    print("ms per token, prefill included (medians of rounds): "
          + ", ".join(f"{k} {statistics.median(v):.3f} ({', '.join(f'{x:.3f}' for x in v)})" for k, v in per_token.items()))
    print("scheduler phases, per call (all rounds): CPU µs / wall µs")
    for name in PHASES:
        cpu, wall, calls = spent[name]
        print(f"  {name:12s} {calls:5d} calls  {cpu / calls / 1e3:8.1f} / {wall / calls / 1e3:8.1f}")


if __name__ == "__main__":
    main()
