"""rows_q8 / experts_q8 on qwen3_moe-150m's shapes (D 512, F 256, 32 experts top-4, random ids) at 8
and 128 x rows, beside rows_gemv / experts_gemv on the same shapes in bf16: medians of 15 calls of
the build each kind of weight runs here (moekit.ops.variant). An A/B runs it from each tree in turn:

  for t in /work/main/src src /work/main/src src; do PYTHONPATH=$t .venv/bin/python benchmarks/q8_rows_ab.py 1; done  # THREADS
"""

from __future__ import annotations

import sys, time, torch
from moekit import ops
from moekit.ops.q8_0 import quantize_q8_0
from moekit.ops.select import variant, widen_batch, bf16_tiles
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
assert ops.load().ok
q8v = variant("q8_0"); bfv = variant("bfloat16")
print("q8", q8v.namespace, "bf16", bfv.namespace)
g = torch.Generator().manual_seed(0)
D, F, E, K = 512, 256, 32, 4
def med(fn, n=15):
    fn(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1e3
shapes = {"qkv": (1024, D), "o": (D, D)}
rq8 = ops.op(q8v.namespace, "rows_q8"); eq8 = ops.op(q8v.namespace, "experts_q8")
rbf = ops.op(bfv.namespace, "rows_gemv"); ebf = ops.op(bfv.namespace, "experts_gemv")
for M in [8, 128]:
    x = torch.randn(M, D, generator=g).bfloat16()
    for name,(n,k) in shapes.items():
        w = torch.randn(n, k, generator=g)
        p = quantize_q8_0(w); wb = w.bfloat16()
        xw = x.float() if widen_batch("bfloat16") else x
        print(f"M={M} {name}: q8 {med(lambda: rq8(x, p, q8v.grouped)):.3f} ms  bf16 {med(lambda: rbf(xw, wb, bfv.grouped)):.3f} ms")
    gu = torch.randn(E, 2*F, D, generator=g); dn = torch.randn(E, D, F, generator=g)
    gq = torch.stack([quantize_q8_0(a) for a in gu]); dq = torch.stack([quantize_q8_0(a) for a in dn])
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)])
    h = torch.randn(M, K, F, generator=g).bfloat16()
    gub = gu.bfloat16(); dnb = dn.bfloat16()
    print(f"M={M} experts gate_up(pre): q8 {med(lambda: eq8(x[:,None], gq, ids, q8v.grouped)):.3f}  bf16 {med(lambda: ebf(x[:,None], gub, ids, bfv.grouped)):.3f}")
    print(f"M={M} experts down: q8 {med(lambda: eq8(h, dq, ids, q8v.grouped)):.3f}  bf16 {med(lambda: ebf(h, dnb, ids, bfv.grouped)):.3f}")
