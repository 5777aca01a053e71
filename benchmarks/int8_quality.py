"""Quality of moekit's int8 weights on the bundled model, against its bf16 (and fp32) weights.

    .venv/bin/python benchmarks/int8_quality.py [--model models/moekit-demo] [--corpus data/corpus]

Per held-out domain (moekit.train.evaluate's windows and scoring): bits per byte, each weight
format scored on the same windows, so the byte count is shared and the ratio is the loss ratio;
teacher-forced top-1 agreement with bf16 (same argmax at every scored position); and free-running
greedy agreement with bf16 (prompts = the first 16 tokens of held-out windows, 32 new tokens:
identical continuations, and the mean share of tokens before the first difference).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

FORMATS = (("bfloat16", "dtype"), ("float32", "dtype"), ("bfloat16", "int8"), ("bfloat16", "int8-experts"),
           ("float32", "int8"))


def main() -> None:
    from moekit.corpus.reader import read_split
    from moekit.engine.loader import load_engine
    from moekit.train.data import tokenize_domains
    from moekit.train.evaluate import windows

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/moekit-demo")
    parser.add_argument("--corpus", default="data/corpus")
    parser.add_argument("--max-tokens", type=int, default=20_000, help="held-out tokens per domain")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8, help="greedy prompts per domain")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    base = load_engine(args.model, dtype="bfloat16", compile=False)
    held = tokenize_domains(base.tokenizer, read_split(args.corpus, "heldout"))
    # Whole windows only, so every batch is rectangular and the bytes counted are the bytes scored.
    chunks = {d: [c for c in windows(s[: args.max_tokens].tolist(), args.window) if len(c) == args.window]
              for d, s in held.items()}
    nbytes = {d: sum(len(base.tokenizer.decode(c[1:]).encode()) for c in cs) for d, cs in chunks.items()}
    prompts = {d: [c[:16] for c in cs[: args.prompts]] for d, cs in chunks.items()}

    results, reference = {}, {}
    for dtype, weights in FORMATS:
        start = time.perf_counter()
        engine = base if (dtype, weights) == ("bfloat16", "dtype") else load_engine(args.model, dtype=dtype, weights=weights, compile=False)
        load_s = time.perf_counter() - start
        name = f"{dtype}/{weights}"
        row = {"load_s": load_s, "domains": {}}
        for domain, cs in chunks.items():
            nll, argmax = score(engine.decoder, cs)
            gen = engine.generate(prompts[domain], max_new_tokens=32, stop_ids=()).token_ids
            if name == "bfloat16/dtype":
                reference[domain] = (argmax, gen)
            ref_argmax, ref_gen = reference[domain]
            row["domains"][domain] = {
                "bits_per_byte": nll / math.log(2) / nbytes[domain],
                "top1_agreement_with_bf16": float((argmax == ref_argmax).float().mean()),
                "greedy_identical_with_bf16": sum(a == b for a, b in zip(gen, ref_gen)) / len(gen),
                "greedy_prefix_share_with_bf16": sum(_prefix(a, b) / len(b) for a, b in zip(gen, ref_gen)) / len(gen),
            }
        row["bits_per_byte"] = (sum(r["bits_per_byte"] * nbytes[d] for d, r in row["domains"].items())
                                / sum(nbytes.values()))
        results[name] = row
        print(f"{name:<22} bits/byte {row['bits_per_byte']:.4f}  load {load_s:.1f} s  "
              + "  ".join(f"{d}: {r['bits_per_byte']:.4f} top1 {r['top1_agreement_with_bf16']:.1%} "
                          f"greedy {r['greedy_prefix_share_with_bf16']:.0%}" for d, r in row["domains"].items()),
              flush=True)
    bf16 = results["bfloat16/dtype"]["bits_per_byte"]
    for name, row in results.items():
        row["bits_per_byte_vs_bf16"] = row["bits_per_byte"] / bf16 - 1
    print(json.dumps({"model": args.model, "threads": args.threads, "max_tokens": args.max_tokens,
                      "window": args.window, "results": results}))


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def score(decoder, chunks: list[list[int]], batch: int = 8) -> tuple[float, torch.Tensor]:
    """(Σ nll in nats, argmax at every scored position, flattened in order) over the windows."""
    total, argmax = 0.0, []
    for begin in range(0, len(chunks), batch):
        group = chunks[begin : begin + batch]
        width = len(group[0])
        ids = torch.tensor(group)  # [B, W]
        with torch.inference_mode():
            logits = decoder(ids, decoder.new_cache(len(group), width), torch.arange(width).expand(len(group), width))
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        total += float(-logp.gather(-1, ids[:, 1:, None]).sum())
        argmax.append(logp.argmax(-1).reshape(-1))
    return total, torch.cat(argmax)


if __name__ == "__main__":
    main()
