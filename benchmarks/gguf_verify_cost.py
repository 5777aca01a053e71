"""One run: verify cost and paged-vs-resident decode on a GGUF (hard links, so the manifest lands here).

usage: .venv/bin/python benchmarks/gguf_verify_cost.py SRC.gguf [SRC.gguf ...]
"""
import os
import sys
import time
from pathlib import Path

from moekit.engine.loader import load_engine
from moekit.weights.gguf_extents import checksum_gguf, manifest_path
from moekit.offload.options import OffloadOptions
from moekit.weights.gguf_spec import spec_from_gguf

PROMPT = [1, 17, 42, 99, 5, 7, 150, 3]
NEW = 32
work = Path("/tmp/gguf-measure")
work.mkdir(exist_ok=True)


def load_s(path, **kw):
    t = time.perf_counter()
    e = load_engine(path, **kw)
    return time.perf_counter() - t, e


def decode(e):
    gen = e.generate([PROMPT], max_new_tokens=NEW, stop_ids=())
    return gen.timing.decode_steps / gen.timing.decode_s, gen.token_ids[0]


for src in map(Path, sys.argv[1:]):
    gguf = work / src.name
    if not gguf.exists():
        os.link(src, gguf)
    manifest_path(gguf).unlink(missing_ok=True)
    print(f"== {src.name} ({gguf.stat().st_size / 1e6:.0f} MB), loadavg {os.getloadavg()}")
    s, _ = load_s(gguf)  # also warms the page cache for what follows
    s, e = load_s(gguf)
    print(f"resident load, no manifest: {s:.2f} s")
    tok_resident, want = decode(e)
    del e
    r = checksum_gguf(gguf, spec_from_gguf(gguf))
    print(f"moekit checksum (write): {r.seconds:.2f} s for {r.nbytes / 1e6:.0f} MB, {r.experts} experts + {r.tensors} tensors")
    r = checksum_gguf(gguf, spec_from_gguf(gguf))
    print(f"moekit checksum (verify every byte): {r.seconds:.2f} s")
    s, e = load_s(gguf)
    print(f"resident load, verified: {s:.2f} s")
    del e
    s, e = load_s(gguf, verify=False)
    print(f"resident load, --no-verify: {s:.2f} s")
    del e
    print(f"resident decode: {tok_resident:.1f} tok/s")
    for verify in (True, False):
        s, e = load_s(gguf, offload=OffloadOptions("50%"), verify=verify)
        tok, got = decode(e)
        st = e.store.stats()
        print(f"paged 50% (verify={verify}): load {s:.2f} s, decode {tok:.1f} tok/s = {tok / tok_resident:.2f}x resident, "
              f"hit rate {st['hit_rate']:.3f}, {st['slots_per_layer']} slots, tokens equal: {got == want}, "
              f"precision {st['expert_precision']}")
        e.close()
    print(f"loadavg after: {os.getloadavg()}")
