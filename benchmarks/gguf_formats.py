"""GGUF files vs the safetensors checkpoint they were converted from, ~150M qwen3_moe: load time,
decode tok/s, greedy tokens and the bytes per token the meter reports, in one run.

The GGUFs are llama.cpp's converter's (`moekit bench decode --vs llama.cpp` makes them in
bench-out/llama.cpp/gguf/, or benchmarks/run_vs_llama_cpp.sh):

    .venv/bin/python benchmarks/make_checkpoints.py --sizes 150m --families qwen3_moe
    .venv/bin/python benchmarks/gguf_formats.py [--new 32] [--repeats 3] [--threads 2]

Every source is loaded --loads times (the first reads the file, the rest the page cache), then all
decode --new tokens greedily at batch 1, round-robin, --repeats times (median and best tok/s).
A GGUF is dequantized at load, so its engine is the dtype's engine and the meter counts the
dtype's bytes; the file's own size is printed beside them. With --weights int8 a Q8_0 GGUF's
dequantized weights are requantized to q8_0 blocks bit-identical to the file's (tests/weights/
test_gguf_exact.py): the engine then runs the file's own bytes, as the checkpoint at int8 does. bench-out/ is git-ignored.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PROMPT = [1, 17, 42, 99, 5, 63, 120, 7, 300, 2048, 11, 12, 400, 9, 31, 77]
CKPT = Path("bench-out/ckpt/qwen3_moe-150m")
GGUF = Path("bench-out/llama.cpp/gguf")


def load(source: Path, dtype: str, weights: str, loads: int):
    """The engine, and the fastest of `loads` loads (the first reads the file, the rest the page cache)."""
    from moekit.engine.loader import load_engine

    times = []
    for _ in range(loads):
        start = time.perf_counter()
        engine = load_engine(source, dtype=dtype, weights=weights, compile=False)
        times.append(time.perf_counter() - start)
    return engine, times


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(rows, new: int, repeats: int, loads: int) -> list[dict]:
    """Load every source, then decode round-robin (each repeat runs every engine once), so a busy
    machine slows all of them alike."""
    engines = [(source, (dtype, weights), *load(source, dtype, weights, loads)) for source, dtype, weights in rows]
    rates: list[list[float]] = [[] for _ in engines]
    gens = [None] * len(engines)
    for _ in range(repeats):
        for i, (_, _, engine, _) in enumerate(engines):
            gens[i] = engine.generate([PROMPT], max_new_tokens=new, stop_ids=())
            rates[i].append(gens[i].timing.decode_tok_s)
    out = []
    for (source, dtype, engine, times), rate, gen in zip(engines, rates, gens):
        out.append({
            "source": str(source), "dtype": dtype[0], "weights": dtype[1], "load_s_first": round(times[0], 3), "load_s_best": round(min(times), 3),
            "decode_tok_s_median": round(statistics.median(rate), 1), "decode_tok_s_best": round(max(rate), 1),
            "bytes_per_token": engine.meter(gen)[-1].bytes_touched,
            "file_bytes": source.stat().st_size if source.is_file() else sum(p.stat().st_size for p in source.glob("*.safetensors")),
            "token_ids": gen.token_ids[0], "notes": list(engine.notes),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=CKPT)
    parser.add_argument("--gguf-dir", type=Path, default=GGUF)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loads", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ggufs = {kind: sorted(args.gguf_dir.glob(f"{args.checkpoint.name}-*-{kind}.gguf")) for kind in ("f32", "q8_0", "bf16")}
    missing = [kind for kind, found in ggufs.items() if not found]
    if missing:
        raise SystemExit(f"no {', '.join(missing)} GGUF of {args.checkpoint} in {args.gguf_dir} "
                         f"(moekit bench decode {args.checkpoint} --vs llama.cpp makes them)")
    rows = [(args.checkpoint, "float32", "dtype"), (ggufs["f32"][0], "float32", "dtype"),
            (ggufs["q8_0"][0], "float32", "dtype"), (args.checkpoint, "bfloat16", "dtype"),
            (ggufs["bf16"][0], "bfloat16", "dtype"), (args.checkpoint, "float32", "int8"),
            (ggufs["q8_0"][0], "float32", "int8")]
    results = measure(rows, args.new, args.repeats, args.loads)
    reference = {(r["dtype"], r["weights"]): r["token_ids"] for r in results if Path(r["source"]).is_dir()}
    print(f"{'source':36} {'dtype':15} {'load s first/best':>17} {'tok/s median/best':>18} {'B/token (meter)':>16} "
          f"{'file MB':>8}  greedy tokens equal to the checkpoint's")
    for r in results:
        same = same_prefix(r["token_ids"], reference.get((r["dtype"], r["weights"]), []))
        label = r["dtype"] if r["weights"] == "dtype" else f"{r['dtype']}+{r['weights']}"
        print(f"{Path(r['source']).name:36} {label:15} {r['load_s_first']:>8.2f} / {r['load_s_best']:<6.2f} "
              f"{r['decode_tok_s_median']:>9.1f} / {r['decode_tok_s_best']:<6.1f} {r['bytes_per_token']:>16,} "
              f"{r['file_bytes'] / 1e6:>8.1f}  {same} of {len(r['token_ids'])}")
    for r in results:
        for note in r["notes"]:
            print(f"  {Path(r['source']).name}: {note}")
    print(json.dumps([{k: v for k, v in r.items() if k != "token_ids"} for r in results]))


if __name__ == "__main__":
    main()
