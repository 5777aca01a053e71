"""A checkpoint's load time and memory: moekit.load in a fresh process per run, runs alternated
between moekit source trees (the working tree's, and e.g. an older commit's), so a load-path change
is measured against its baseline in one run. Nothing here is imported by moekit.

    git archive b773ac8 src | tar -x -C /tmp/old     # the baseline's source tree
    .venv/bin/python benchmarks/load_cost.py FILE.gguf --src /tmp/old/src,src --rounds 1

Per run: load seconds (moekit.load, dtype bf16), peak RSS (VmHWM) and RSS after the load, and the
greedy tokens of 3 steps after a fixed 4-id prompt (the same tokens are the check that both trees
loaded the same weights). `uptime` is printed before each run: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(path: str, threads: int) -> dict:
    import torch

    import moekit

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    engine = moekit.load(path, dtype="bfloat16", compile=False)
    load_s = time.perf_counter() - t0
    peak, after = _status("VmHWM"), _status("VmRSS")
    tokens = engine.generate([[17, 42, 99, 5]], max_new_tokens=3, stop_ids=()).token_ids[0]
    return {"load_s": round(load_s, 1), "peak_rss_gib": round(peak / 2**30, 2), "rss_after_load_gib": round(after / 2**30, 2),
            "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--src", default="src", help="comma-separated moekit source trees (relative to the repo or absolute)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.checkpoint, args.threads)))
        return
    for r in range(args.rounds):
        for src in args.src.split(","):
            tree = (REPO / src).resolve()
            up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
            done = subprocess.run([sys.executable, __file__, args.checkpoint, "--child", "--threads", str(args.threads)],
                                  stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(tree)))
            if done.returncode != 0:
                print(json.dumps({"round": r, "src": str(tree), "failed": done.returncode}), flush=True)
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({"round": r, "src": str(tree), **result, "uptime": up}), flush=True)


if __name__ == "__main__":
    main()
