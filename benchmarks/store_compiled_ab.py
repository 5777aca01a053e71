"""The expert store's decode, eager against --compile (the store's layers and prefetch guesses as
opaque ops in the compiled step, moekit.offload.graph_store), batch 1, in one process.

    .venv/bin/python benchmarks/store_compiled_ab.py bench-out/ckpt/qwen3_moe-150m --expert-memory 50% --rounds 4

Two engines of the checkpoint, each with its own store under the same budget (the baseline: eager;
the other: compiled, its graph compiled or loaded before the clock), at --threads (1 by default).
Each round generates --tokens greedy tokens from one prompt (a new one each round) on each, the
order alternating round by round (the machine is shared: compare within a round). Both stores see the same requests
in the same order, so their reads must be equal, and the tokens too: both are checked and printed.
Experts are read from the page cache after their first read (the files are not dropped). Prints
each run's decode tokens/s and store figures, then the median per side and the ratio
compiled ÷ eager per round and over the medians. Nothing here is imported by moekit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

import torch

from moekit.engine.loader import load_engine
from moekit.offload.options import OffloadOptions

PROMPT = [17, 42, 99, 5, 7, 150, 3, 88, 23, 61, 200, 11, 64, 31, 250, 9]


def prompt(r: int) -> list[int]:
    """Round r's prompt (both sides the same): a new one each round, so each round's tokens route anew."""
    return [3 + (t * (r + 1) + 97 * r) % 30000 for t in PROMPT]


def one_run(engine, ids: list[int], tokens: int) -> dict:
    before = engine.store.stats()
    gen = engine.generate(ids, max_new_tokens=tokens, stop_ids=())
    after = engine.store.stats()
    return {"decode_tok_s": gen.timing.decode_tok_s, "tokens": gen.token_ids[0],
            "accesses": after["accesses"] - before["accesses"], "loads": after["loads"] - before["loads"],
            "disk_bytes": after["disk_bytes"] - before["disk_bytes"],
            "stall_ms_per_token": (after["stall_s"] - before["stall_s"]) / tokens * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--expert-memory", default="50%")
    ap.add_argument("--prefetch", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = OffloadOptions(args.expert_memory, prefetch=args.prefetch)
    engines = {side: load_engine(args.ckpt, dtype=args.dtype, offload=options, compile=side == "compiled")
               for side in ("eager", "compiled")}
    assert engines["compiled"].decoder.compiled is not None, engines["compiled"].notes
    warm = engines["compiled"].decoder.compiled.warm_up((1,))
    print(json.dumps({"compiled_warm_up_s": round(warm, 1), "budget": args.expert_memory, "prefetch": args.prefetch,
                      "slots_per_layer": engines["eager"].store.slots, "threads": args.threads, "dtype": args.dtype}))
    speeds: dict[str, list[float]] = {side: [] for side in engines}
    ratios = []
    with torch.inference_mode():
        for r in range(args.rounds):
            up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            runs = {side: one_run(engines[side], prompt(r), args.tokens) for side in order}
            same = runs["eager"].pop("tokens") == runs["compiled"].pop("tokens")
            same_reads = all(runs["eager"][k] == runs["compiled"][k] for k in ("accesses", "loads", "disk_bytes"))
            for side, run in runs.items():
                speeds[side].append(run["decode_tok_s"])
            ratios.append(runs["compiled"]["decode_tok_s"] / runs["eager"]["decode_tok_s"])
            shown = {side: {k: round(v, 2) if isinstance(v, float) else v for k, v in run.items()} for side, run in runs.items()}
            print(json.dumps({"round": r, "order": order, **shown, "compiled_vs_eager": round(ratios[-1], 3),
                              "same_tokens": same, "same_reads": same_reads, "uptime": up}), flush=True)
    med = {side: statistics.median(v) for side, v in speeds.items()}
    print(json.dumps({"median_decode_tok_s": {k: round(v, 1) for k, v in med.items()},
                      "compiled_vs_eager_of_medians": round(med["compiled"] / med["eager"], 3),
                      "compiled_vs_eager_per_round": [round(x, 3) for x in ratios]}))
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
