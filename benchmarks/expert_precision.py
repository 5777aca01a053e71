"""Routed experts packed at several precisions on the bundled model: held-out bits per byte against
the bytes the experts hold.

    .venv/bin/python benchmarks/expert_precision.py [--model models/moekit-demo] [--profile-corpus data/corpus]

1. A profile, as `moekit profile` writes it (moekit.analysis.profile.build_profile): greedy
   continuations of the first documents of each domain of the corpus's TRAIN split, so the experts
   called hot are not chosen on the text that is scored.
2. Per split, `moekit pack --precision P` or `--precision-by-profile profile.json --hot bf16 --cold
   Q --hot-share 25%` into a temporary folder, loaded with bf16 activations (a pack with int8/int4
   experts runs them through the expert store, every expert resident).
3. Bits per byte on the held-out sample shipped with moekit (whole 256-token windows, teacher
   forced, bytes of the scored tokens' text), and greedy agreement with all-bf16 (the first 16
   tokens of held-out windows as prompts, 32 new tokens: identical continuations, and the mean
   share of tokens before the first difference).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from int8_quality import _prefix, score  # one scoring for both benchmarks (run from benchmarks/)

SPLITS = (  # name, --precision or (hot, cold) with --hot-share
    ("all bf16", "bf16"),
    ("all int8", "int8"),
    ("hot 25% bf16 + cold int8", ("bf16", "int8")),
    ("hot 25% bf16 + cold int4", ("bf16", "int4")),
    ("all int4", "int4"),
    # The control: as many bf16 experts, but the least used ones (the 75% most used at int4).
    ("least used 25% bf16 + the rest int4", ("int4", "bf16", 0.75)),
)


def main() -> None:
    from moekit.analysis.sample import SAMPLE
    from moekit.corpus.reader import read_split
    from moekit.engine.loader import load_engine
    from moekit.offload.pack import pack_experts
    from moekit.offload.precision import by_frequency, read_counts, uniform
    from moekit.analysis.profile import build_profile
    from moekit.spec import load_spec
    from moekit.train.data import tokenize_domains
    from moekit.train.evaluate import windows

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/moekit-demo")
    parser.add_argument("--profile-corpus", default="data/corpus", help="its train split is profiled")
    parser.add_argument("--heldout", default=str(SAMPLE), help="a corpus folder whose held-out split is scored")
    parser.add_argument("--profile-docs", type=int, default=8, help="train documents per domain profiled")
    parser.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens per domain")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4, help="greedy prompts per domain")
    parser.add_argument("--hot-share", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = Path(args.model)
    spec = load_spec(str(model))

    base = load_engine(model, dtype="bfloat16", compile=False)
    work = Path(tempfile.mkdtemp(prefix="moekit-precision-"))
    train = read_split(Path(args.profile_corpus), "train")
    texts = [doc[:400] for docs in train.values() for doc in docs[: args.profile_docs]]
    profile = work / "profile.json"
    profile.write_text(json.dumps(build_profile(base, texts, max_new_tokens=32, top=spec.layers[0].ffn.num_experts // 4)))
    counts = read_counts(profile, model, spec)

    held = tokenize_domains(base.tokenizer, read_split(Path(args.heldout), "heldout"))
    chunks = {d: [c for c in windows(s[: args.max_tokens].tolist(), args.window) if len(c) == args.window]
              for d, s in held.items()}
    nbytes = sum(len(base.tokenizer.decode(c[1:]).encode()) for cs in chunks.values() for c in cs)
    prompts = [c[:16] for cs in chunks.values() for c in cs[: args.prompts]]

    rows, reference = [], None
    for name, how in SPLITS:
        if isinstance(how, str):
            precisions = uniform(spec, how)
        else:
            precisions = by_frequency(counts, how[0], how[1], how[2] if len(how) > 2 else args.hot_share)
        start = time.perf_counter()
        packed = pack_experts(model, work / name.replace(" ", "-").replace("%", ""), precisions=precisions)
        engine = load_engine(packed.folder, dtype="bfloat16", compile=False)
        load_s = time.perf_counter() - start
        nll, argmax = 0.0, []
        for cs in chunks.values():
            total, top = score(engine.decoder, cs)
            nll += total
            argmax.append(top)
        argmax = torch.cat(argmax)
        run = engine.generate(prompts, max_new_tokens=32, stop_ids=())
        gen = run.token_ids
        metered = engine.meter(run)  # bytes a token reads: dense at bf16, each chosen expert its own
        held_bytes = expert_bytes(engine, spec)
        engine.close()
        if reference is None:
            reference = (argmax, gen)
        ref_argmax, ref_gen = reference
        rows.append({
            "split": name,
            "precision": packed.precision,
            "bits_per_byte": nll / math.log(2) / nbytes,
            "resident_expert_bytes": held_bytes,
            "meter_bytes_per_token": sum(t.bytes_touched for t in metered) / len(metered),
            "top1_agreement_with_bf16": float((argmax == ref_argmax).float().mean()),
            "greedy_identical_with_bf16": sum(a == b for a, b in zip(gen, ref_gen)) / len(gen),
            "greedy_prefix_share_with_bf16": sum(_prefix(a, b) / len(b) for a, b in zip(gen, ref_gen)) / len(gen),
            "pack_and_load_s": load_s,
        })
        print(json.dumps(rows[-1]), flush=True)
    bf16 = rows[0]
    print(f"\nheld-out bytes scored: {nbytes:,} ({args.max_tokens} tokens per domain at most, windows of {args.window}); "
          f"greedy: {len(prompts)} prompts × 32 tokens; threads {args.threads}\n")
    print("| split | bits per byte | vs all bf16 | resident expert bytes | vs all bf16 | meter bytes/token | top-1 agreement | greedy identical | greedy prefix |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['split']} | {r['bits_per_byte']:.4f} | {r['bits_per_byte'] / bf16['bits_per_byte'] - 1:+.2%} "
              f"| {r['resident_expert_bytes'] / 1e6:.2f} MB | {r['resident_expert_bytes'] / bf16['resident_expert_bytes']:.3f}× "
              f"| {r['meter_bytes_per_token'] / 1e6:.3f} MB | {r['top1_agreement_with_bf16']:.1%} | {r['greedy_identical_with_bf16']:.0%} "
              f"| {r['greedy_prefix_share_with_bf16']:.0%} |")


def expert_bytes(engine, spec) -> int:
    """Bytes every routed expert holds when all are resident: the store's own figure per expert,
    or (a plain resident load of float experts) their parameters at the engine's dtype."""
    if engine.store is not None:
        return sum(sum(s.memory_bytes) for s in engine.store.layers.values())
    from moekit.offload.attach import expert_nbytes

    return expert_nbytes(spec, torch.bfloat16) * sum(spec.layers[l].ffn.num_experts for l in spec.moe_layers)


if __name__ == "__main__":
    main()
