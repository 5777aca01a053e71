"""The compiled int8 prefill and its graphs' warm load, in one process of one tree: load qwen3_moe
with `--weights int8` compiled, warm up the batch-1 decode graph and the served prefill graphs
(timed: from a warm cache, loaded if saved, else traced again), then prefill 1 × 8 and 16 × 8
tokens (after one untimed each) and decode 64 tokens at batch 1 by generate. Prints one JSON line.
An A/B runs it from each tree's PYTHONPATH in turn:

  for t in /work/main/src src /work/main/src src; do PYTHONPATH=$t .venv/bin/python \\
      benchmarks/int8_prefill_ab.py bench-out/ckpt/qwen3_moe-150m 9 1; done   # ROUNDS THREADS
"""

from __future__ import annotations

import json, statistics, sys, time
import torch
from moekit.engine.loader import load_engine
ckpt = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
t0 = time.perf_counter()
engine = load_engine(ckpt, weights="int8", compile=True)
dec = engine.decoder
from moekit.model.compiled_step import SERVED_PREFILLS
load_s = time.perf_counter() - t0
t1 = time.perf_counter()
dec.compiled.warm_up((1,), prefills=SERVED_PREFILLS)
warm_s = time.perf_counter() - t1
gen = torch.Generator().manual_seed(0)
def once(rows, tokens):
    cache = dec.new_cache(rows, tokens)
    ids = torch.randint(0, dec.spec.vocab_size, (rows, tokens), generator=gen)
    pos = torch.arange(tokens)[None].expand(rows, tokens)
    s = time.perf_counter()
    with torch.inference_mode():
        dec(ids, cache, pos, [], last_only=True)
    return (time.perf_counter() - s) * 1e3
res = {}
steps = {}
for rows in (1, 16):
    once(rows, 8)
    before = dec.compiled.direct_steps
    res[rows] = [once(rows, 8) for _ in range(rounds)]
    steps[rows] = dec.compiled.direct_steps - before
def gen(n):
    s = time.perf_counter()
    engine.generate([[5, 9, 33, 7, 81, 14, 3, 60]], max_new_tokens=n, stop_ids=())
    return time.perf_counter() - s
gen(4)
itl = [(gen(65) - gen(1)) / 64 * 1e3 for _ in range(3)]
res["itl"] = itl
print(json.dumps({"graph_runs": steps, "itl_ms": statistics.median(itl), "load_s": load_s, "warm_s": warm_s, "loaded_graphs": dec.compiled.loaded_graphs, "direct": len(dec.compiled.graphs),
                  "p1_ms": statistics.median(res[1]), "p16_ms": statistics.median(res[16]), "p1_min": min(res[1]), "p16_min": min(res[16])}))
