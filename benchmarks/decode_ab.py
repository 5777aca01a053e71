"""Decode tokens/s of two trees' `moekit bench decode --compile` (or, --eager, their eager step) on one checkpoint, alternating
(A B B A per round) in one run, each run a fresh process with that tree's sources first on the path;
prints each side's median and the ratio after / before.

    git worktree add /work/wt/kernels-base 1f9faaf
    .venv/bin/python benchmarks/decode_ab.py bench-out/ckpt/qwen3_moe-150m --before /work/wt/kernels-base \
        --dtype bfloat16 --weights dtype --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def eager_flag(tree: Path) -> list[str]:
    """How `tree`'s bench decode is told to run eager: --eager since the compiled step became the
    default (issue 35); before, no flag."""
    options = tree / "src" / "moekit" / "commands" / "options.py"
    return ["--eager"] if options.is_file() and "--compile/--eager" in options.read_text() else []


def tok_s(tree: Path, args) -> dict[int, float]:
    """batch → moekit tokens/s of one `bench decode` process run from tree."""
    compile_flag = eager_flag(tree) if args.eager else ["--compile"]
    command = [sys.executable, "-m", "moekit", "bench", "decode", str(Path(args.checkpoint).resolve()), *compile_flag, "--dtype", args.dtype,
               "--weights", args.weights, "--batch", args.batch, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--json"]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return {r["batch"]: r["moekit_tok_s"] for r in json.loads(done.stdout)["results"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--before", type=Path, required=True, help="the tree to compare against")
    parser.add_argument("--after", type=Path, default=HERE, help="default: this tree")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="dtype")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="the eager step (--eager, or no flag on a tree from before it)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of --order")
    parser.add_argument("--order", default="ABBA", help="one round's sides in turn, A after and B before (default ABBA)")
    args = parser.parse_args()
    runs: dict[str, list[dict[int, float]]] = {"after": [], "before": []}
    for _ in range(args.rounds):
        for side in ("after" if c == "A" else "before" for c in args.order):
            runs[side].append(tok_s(getattr(args, side), args))
            print(f"{side}: {runs[side][-1]}", file=sys.stderr, flush=True)
    for batch in sorted(runs["after"][0]):
        after = statistics.median(r[batch] for r in runs["after"])
        before = statistics.median(r[batch] for r in runs["before"])
        print(f"{args.checkpoint} {args.dtype} weights={args.weights} {'eager' if args.eager else 'compile'} batch {batch}: after {after:.1f} tok/s, "
              f"before {before:.1f} tok/s, after/before {after / before:.3f} ({len(runs['after'])} runs each)")


if __name__ == "__main__":
    main()
