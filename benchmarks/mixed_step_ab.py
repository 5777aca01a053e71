"""A long prompt's chunk beside the running rows' decode: one mixed step against the two separate
forwards (the chunk's prefill graph, then the decode step's), per chunk size, in one process.

Each round times, alternating: the decode step alone, then for each --chunks size the separate
forwards and the mixed step (moekit.model.mixed_step), on the compiled decoder of CKPT with --rows
running rows at --length slots each and a prompt cache of --prompt tokens. Printed: the median
milliseconds of each, and what a chunk adds to its step (its time less the decode alone). The graphs
are loaded as a server of --max-batch rows saved them (`moekit serve CKPT --max-batch 16
--max-context 576 --warm-up` first, or they compile here).

  PYTHONPATH=src .venv/bin/python benchmarks/mixed_step_ab.py bench-out/ckpt/qwen3_moe-150m --chunks 128,64
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--chunks", default="128,64")
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=576)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from moekit.engine.loader import load_engine
    from moekit.model.compiled_step import MIXED_STEP, PrefillShape

    engine = load_engine(args.checkpoint, dtype=args.dtype)
    decoder = engine.decoder
    decoder.compiled.warm_up((1, 2), rows=args.max_batch, prefills=(PrefillShape(1, False), MIXED_STEP),
                             say=lambda line: print(line, flush=True))
    chunks = [int(c) for c in args.chunks.split(",")]
    vocab = decoder.spec.vocab_size
    gen = torch.Generator().manual_seed(0)
    cache = decoder.new_cache(args.max_batch, args.max_context)
    ids = torch.randint(3, vocab, (args.rows, 1), generator=gen)
    lengths = torch.full((args.rows,), args.length, dtype=torch.int64)
    prompt = torch.randint(3, vocab, (1, args.prompt), generator=gen)
    chunk_cache = decoder.new_cache(1, args.prompt + 1)

    def decode():
        decoder.forward_rows(ids, cache, lengths)

    def separate(t):
        chunk_cache.length = 0
        decoder(prompt[:, :t], chunk_cache, torch.arange(t)[None], last_only=True)
        decoder.forward_rows(ids, cache, lengths)

    def mixed(t):
        chunk_cache.length = 0
        assert decoder.forward_mixed(ids, cache, lengths, prompt[:, :t], chunk_cache) is not None

    cases = [("decode alone", decode)]
    for t in chunks:
        cases += [(f"{t}-token chunk, separate", lambda t=t: separate(t)), (f"{t}-token chunk, mixed", lambda t=t: mixed(t))]
    times = {name: [] for name, _ in cases}
    with torch.inference_mode():
        for name, fn in cases:  # once each: every graph loaded before the clock
            fn()
        calls = decoder.compiled.direct_steps
        for _ in range(args.rounds):
            for name, fn in cases:
                began = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - began)
    runs = decoder.compiled.direct_steps - calls
    want = args.rounds * (1 + 3 * len(chunks))
    print(f"graph calls {runs} (expected {want}: every case ran a compiled graph)")
    alone = statistics.median(times["decode alone"])
    for name, _ in cases:
        ms = statistics.median(times[name]) * 1e3
        extra = "" if name == "decode alone" else f"  (+{ms - alone * 1e3:.1f} ms over the decode alone)"
        print(f"{name:28s} {ms:7.1f} ms median of {args.rounds}{extra}")


if __name__ == "__main__":
    main()
