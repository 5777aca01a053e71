"""Substitution on a miss (--substitute int4) against stalling, on the bundled model paged at a budget:
greedy agreement with the resident engine, bits per byte of held-out windows, stall seconds and the
accesses the int4 stand-ins served. One run, one process; the resident engine is the baseline.

  python benchmarks/substitution.py [--budget 25%] [--prompts 2] [--new 32] [--windows 4]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from moekit.analysis.policy_eval import token_bytes
from moekit.analysis.sample import SAMPLE
from moekit.corpus.reader import read_split
from moekit.engine.default_model import default_checkpoint
from moekit.engine.loader import load_engine
from moekit.offload.options import OffloadOptions


def score(engine, windows: list[list[int]], nbytes: torch.Tensor) -> float:
    """Bits per byte of teacher-forced windows, one window a forward (as a paged prefill runs)."""
    bits = size = 0.0
    for w in windows:
        ids = torch.tensor([w])
        with torch.inference_mode():
            logits = engine.decoder(ids, engine.decoder.new_cache(1, len(w)), torch.arange(len(w))[None])
        logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
        bits += float(-logp.gather(1, ids[0, 1:, None]).sum()) / math.log(2)
        size += float(nbytes[ids[0, 1:]].sum())
    return bits / size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--prompts", type=int, default=2, help="held-out documents per domain continued greedily")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--windows", type=int, default=4, help="held-out windows of 128 tokens per domain scored")
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = default_checkpoint()
    held = read_split(SAMPLE, "heldout")
    out = {}
    for name, offload in (("resident", None), ("stall", OffloadOptions(args.budget)),
                          ("int4", OffloadOptions(args.budget, substitute="int4"))):
        engine = load_engine(folder, dtype="float32", offload=offload, compile=False)
        try:
            nbytes = token_bytes(engine.tokenizer, engine.spec.vocab_size)
            prompts = [engine.encode(t)[:128] for docs in held.values() for t in docs[: args.prompts]]
            windows = [engine.encode(t)[:128] for docs in held.values() for t in docs[args.prompts : args.prompts + args.windows]]
            gens = [engine.generate(p, max_new_tokens=args.new, stop_ids=(), record_routing=False) for p in prompts]
            bpb = score(engine, windows, nbytes)
            stats = engine.store.stats() if engine.store is not None else {}
            out[name] = {"tokens": [g.token_ids[0] for g in gens], "bits_per_byte": bpb,
                         "decode_s": sum(g.timing.decode_s for g in gens),
                         **{k: stats.get(k) for k in ("stall_s", "hit_rate", "substituted", "accesses", "substitute_bytes")}}
        finally:
            engine.close()
    ref = out["resident"]["tokens"]
    for name, r in out.items():
        agree = [next((i for i, (a, b) in enumerate(zip(t, w)) if a != b), len(w)) / len(w) for t, w in zip(r.pop("tokens"), ref)]
        r["generated_agreement"] = sum(agree) / len(agree)
        r["delta_bits_per_byte"] = r["bits_per_byte"] - out["resident"]["bits_per_byte"]
    print(json.dumps({"budget": args.budget, "prompts": len(ref), "new_tokens": args.new, **out}, indent=1))


if __name__ == "__main__":
    main()
