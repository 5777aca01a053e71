"""Prefill tok/s: moekit's prefill of one prompt against llama.cpp's (`llama-bench -p N -n 0`), alternating.

For each prompt length and round, in one run: llama-bench on the GGUF (made by llama.cpp's own
converter from the same checkpoint) for `-r` repetitions, then moekit's prefill (Decoder.forward
over N random ids, last_only, a fresh cache each time: what `moekit run` and the server do) as
many times, and the ratio of the two medians of that round. Both sides use --threads.

  PYTHONPATH=src .venv/bin/python benchmarks/prefill_vs_llama_bench.py CKPT --gguf bench-out/gguf/qwen3_moe-150m-f32.gguf \
      --dtype float32 --lengths 64 512 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from moekit.bench.llama_cpp import DEFAULT_ROOT
from moekit.engine.loader import load_engine


def llama_bench(binary: Path, gguf: Path, length: int, threads: int, reps: int) -> float:
    """llama-bench's mean prompt tok/s over `reps` repetitions of a prompt of `length` tokens."""
    cmd = [str(binary), "-m", str(gguf), "-p", str(length), "-n", "0", "-t", str(threads), "-r", str(reps), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
    [row] = json.loads(done.stdout)
    return float(row["avg_ts"])


def moekit_prefill(decoder, length: int, reps: int) -> float:
    """moekit's median prompt tok/s over `reps` prefills of `length` random ids."""
    ids = torch.randint(3, decoder.spec.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    positions = torch.arange(length)[None]
    times = []
    with torch.inference_mode():
        for i in range(reps + 1):
            cache = decoder.new_cache(1, length)
            start = time.perf_counter()
            decoder(ids, cache, positions, last_only=True)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - start)
    return length / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bench", type=Path, default=DEFAULT_ROOT / "server-build" / "bin" / "llama-bench")
    parser.add_argument("--compile", action="store_true", help="load as `--compile` does (the Hub layout the compiled step reads)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine(args.checkpoint, dtype=args.dtype, compile=args.compile)
    for length in args.lengths:
        for r in range(args.rounds):
            theirs = llama_bench(args.llama_bench, args.gguf, length, args.threads, args.reps)
            ours = moekit_prefill(engine.decoder, length, args.reps)
            print(json.dumps({"dtype": args.dtype, "compile": args.compile, "T": length, "round": r,
                              "llama_bench_tok_s": round(theirs, 1), "moekit_tok_s": round(ours, 1),
                              "ratio": round(ours / theirs, 3)}), flush=True)


if __name__ == "__main__":
    main()
