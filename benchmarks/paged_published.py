"""Bytes per expert on disk and in a slot, and paged vs resident decode tok/s, for MXFP4 / FP8 vs bf16.

    .venv/bin/python benchmarks/paged_published.py [--budget 50%] [--new 32] [--dtype bfloat16]
Copies (hard links) bench-out/ckpt/<name> to a scratch folder (/tmp/pagebench/<name>) so the manifest the first paged
run writes does not land in the shared bench-out folders."""
import argparse, os, shutil
from pathlib import Path

import torch

from moekit.engine.loader import load_engine
from moekit.weights.manifest import read_manifest
from moekit.offload.options import OffloadOptions

PROMPT = [1, 17, 42, 99, 5, 63, 120, 7, 300, 2048, 11, 12]


def linked(name):
    src, dst = Path("bench-out/ckpt") / name, Path("/tmp/pagebench") / name
    if not dst.exists():
        dst.mkdir(parents=True)
        for p in src.iterdir():
            if p.name == "moekit-experts.json":
                continue
            (os.link if p.suffix == ".safetensors" else shutil.copy)(p, dst / p.name)
    return dst


def tok_s(engine, new, repeats):
    best = 0.0
    for _ in range(repeats):
        gen = engine.generate(PROMPT, max_new_tokens=new, stop_ids=())
        best = max(best, gen.timing.decode_tokens / gen.timing.decode_s)
    return best, gen.token_ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("names", nargs="*", default=["gpt_oss-150m", "gpt_oss-150m-mxfp4", "deepseek_v3-150m", "deepseek_v3-150m-fp8"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"load average {os.getloadavg()}")
    print("| checkpoint | disk bytes / expert | slot bytes / expert | bits / weight in a slot | slots / layer | resident tok/s | paged tok/s | paged / resident | hit rate | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.names:
        folder = linked(name)
        resident = load_engine(folder, dtype=args.dtype, compile=False)
        r, want = tok_s(resident, args.new, args.repeats)
        spec = resident.spec
        del resident
        paged = load_engine(folder, dtype=args.dtype, offload=OffloadOptions(args.budget), compile=False)
        try:
            p, got = tok_s(paged, args.new, args.repeats)
            stats = paged.store.stats()
        finally:
            paged.close()
        ex = read_manifest(folder).experts[spec.moe_layers[0], 0]
        moe = spec.layers[spec.moe_layers[0]].ffn
        weights = 3 * moe.expert.width * moe.expert.hidden_size
        print(f"| {name} | {ex.nbytes:,} | {stats['expert_bytes']:,} | {stats['expert_bytes'] * 8 / weights:.2f} | "
              f"{stats['slots_per_layer']} of {moe.num_experts} | {r:.1f} | {p:.1f} | {p / r:.2f}× | "
              f"{stats['hit_rate']:.2f} | {got == want} |", flush=True)
    print(f"load average {os.getloadavg()}")


main()
