"""What each expert-budget tier of `moekit serve` costs in quality, on the bundled model.

Per tier (its K): the active share per token, held-out bits per byte per domain (the corpus's
held-out split, windows of 256 tokens) and greedy agreement with tier S: prompts cut from held-out
documents, 32 greedy tokens per tier through the serving scheduler, the share of positions where
the tier writes tier S's token and the share of continuations identical to tier S's.

  .venv/bin/moekit corpus build data/corpus          # once
  .venv/bin/python benchmarks/tier_quality.py [--corpus data/corpus] [--max-tokens 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from moekit.corpus.reader import read_split
from moekit.engine.default_model import bundled_model_path
from moekit.engine.loader import load_engine
from moekit.engine.scheduler import TIERS, Request, Scheduler, generate_batch, tier_top_k
from moekit.model.moe import MoE
from moekit.train.data import tokenize_domains
from moekit.train.evaluate import score_windows, windows


def bits_per_byte(engine, ids: list[int], top_k: int, window: int) -> tuple[float, int]:
    decoder = engine.decoder
    moe_layers = [i for i, b in enumerate(decoder.layers) if isinstance(b.ffn, MoE)]
    experts = decoder.layers[moe_layers[0]].ffn.experts.num_experts
    chunks = windows(ids, window)
    nll, _, _ = score_windows(decoder, chunks, experts, moe_layers, batch=8, top_k=top_k)
    scored_bytes = sum(len(engine.decode(c[1:]).encode("utf-8")) for c in chunks)
    return nll / math.log(2) / scored_bytes, scored_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=bundled_model_path())
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--max-tokens", type=int, default=20000, help="held-out tokens scored per domain")
    parser.add_argument("--prompts-per-domain", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = load_engine(args.checkpoint, compile=False)
    held_texts = read_split(args.corpus, "heldout")
    held = tokenize_domains(engine.tokenizer, held_texts)
    model_k = max(engine.decoder.spec.layers[i].ffn.top_k for i in engine.decoder.spec.moe_layers)
    ks = {tier: tier_top_k(tier, model_k) for tier in TIERS}
    scheduler = Scheduler(engine.decoder, max_batch=16)
    counts = scheduler.counts
    report: dict = {"checkpoint": str(args.checkpoint), "model_k": model_k, "tiers": {}}
    prompts = []
    for domain, docs in held_texts.items():
        for doc in docs[: args.prompts_per_domain]:
            ids = engine.encode(doc)[:24]
            if len(ids) >= 4:
                prompts.append(ids)
    greedy: dict[int, list[list[int]]] = {}
    for k in sorted(set(ks.values()), reverse=True):
        requests = [Request(prompt=p, max_new_tokens=args.new, top_k=k) for p in prompts]
        greedy[k] = [o.token_ids for o in generate_batch(scheduler, requests)]
    for tier, k in ks.items():
        used = {layer: k for layer in counts.top_k}
        row = {"top_k": k, "active_share": counts.active(used) / counts.total_params, "bits_per_byte": {}}
        for domain, stream in held.items():
            bpb, nbytes = bits_per_byte(engine, stream[: args.max_tokens].tolist(), k, 256)
            row["bits_per_byte"][domain] = bpb
        ref, ours = greedy[model_k], greedy[k]
        same = sum(a == b for r, o in zip(ref, ours) for a, b in zip(r, o))
        row["token_agreement"] = same / sum(len(r) for r in ref)
        row["identical_continuations"] = sum(r == o for r, o in zip(ref, ours)) / len(ref)
        report["tiers"][tier] = row
    s = report["tiers"]["S"]["bits_per_byte"]
    print(f"{'tier':5} {'K':>2} {'active':>7} " + " ".join(f"{d:>10}" for d in s) + "  tokens = S   identical")
    for tier, row in report["tiers"].items():
        cells = " ".join(f"{row['bits_per_byte'][d]:.3f}({row['bits_per_byte'][d] / s[d] - 1:+.1%})" for d in s)
        print(f"{tier:5} {row['top_k']:>2} {row['active_share']:>7.2%} {cells}  {row['token_agreement']:>9.1%} {row['identical_continuations']:>10.1%}")
    print(f"greedy agreement over {len(prompts)} held-out prompts × {args.new} tokens")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
