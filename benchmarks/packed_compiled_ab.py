"""Batch-1 decode tok/s of checkpoints whose routed experts stay packed (MXFP4, FP8), eager against
compiled (`--compile`: moekit::experts_mxfp4 / experts_fp8 inside the graph), in one run: each side
is a `moekit bench decode` process, the two alternating for --rounds rounds, so that a noisy
neighbour slows both alike; the ratio is the compiled median over the eager median.

    .venv/bin/python benchmarks/packed_compiled_ab.py --ckpt bench-out/packed --dtype float32 --rounds 3

The checkpoints are benchmarks/quantized_formats.py's (gpt_oss-150m-mxfp4, deepseek_v3-150m-fp8),
written under --ckpt where missing (deepseek_v3-150m from benchmarks/make_checkpoints.py first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import quantized_formats  # benchmarks/, on sys.path as the script's folder

ROOT = Path(__file__).resolve().parents[1]


def checkpoints(root: Path) -> list[Path]:
    """gpt_oss-150m-mxfp4 and deepseek_v3-150m-fp8 under root, written where missing."""
    oss, oss_mx, ds_fp8 = root / "gpt_oss-150m", root / "gpt_oss-150m-mxfp4", root / "deepseek_v3-150m-fp8"
    if not (oss_mx / "config.json").is_file():
        if not (oss / "config.json").is_file():
            quantized_formats.make_gpt_oss(oss)
        quantized_formats.make_mxfp4(oss, oss_mx)
    if not (ds_fp8 / "config.json").is_file():
        quantized_formats.make_fp8(ROOT / "bench-out/ckpt/deepseek_v3-150m", ds_fp8)
    return [oss_mx, ds_fp8]


def decode_tok_s(ckpt: Path, compile_step: bool, args) -> float:
    """moekit's batch-1 decode tok/s (the median of its --repeats runs) in a process of its own."""
    cmd = [sys.executable, "-m", "moekit", "bench", "decode", str(ckpt), "--batch", "1", "--threads", str(args.threads),
           "--dtype", args.dtype, "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--json"]
    run = subprocess.run(cmd + (["--compile"] if compile_step else ["--eager"]), capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {run.returncode}\n{run.stderr[-2000:]}")
    compiled = "decode steps run as one compiled graph" in run.stderr
    if compiled != compile_step:
        raise SystemExit(f"{ckpt.name}: expected {'a compiled' if compile_step else 'an eager'} step; notes:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout)["results"][0]["moekit_tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=ROOT / "bench-out/ckpt")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(f"{args.dtype}, batch 1, {args.threads} thread(s), {args.tokens} tokens, {args.rounds} alternating rounds, "
          f"started {time.strftime('%F %T')}")
    for ckpt in checkpoints(args.ckpt):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for compile_step in (False, True):
                times[compile_step].append(decode_tok_s(ckpt, compile_step, args))
        eager, compiled = (statistics.median(times[side]) for side in (False, True))
        print(json.dumps({"checkpoint": ckpt.name, "eager_tok_s": [round(t, 1) for t in times[False]],
                          "compiled_tok_s": [round(t, 1) for t in times[True]], "eager_median": round(eager, 1),
                          "compiled_median": round(compiled, 1), "compiled_vs_eager": round(compiled / eager, 2)}))
    print(f"ended {time.strftime('%F %T')}")


if __name__ == "__main__":
    main()
