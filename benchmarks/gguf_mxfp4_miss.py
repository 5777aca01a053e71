"""One paged miss of a gpt-oss GGUF's MXFP4 expert, as the expert store's worker does it (the mmap
threshold pinned, one thread, the file's pages in the page cache): the bytes read with `pread` and
their nibbles reordered, into fresh memory with another version of moekit.weights.gguf_mxfp4 (the
way a miss went before the store kept slots for these experts) against into a reused slot with the
working tree's. Alternated, several rounds, the same experts; checks both give the same bytes.
Nothing here is imported by moekit.

    git show a890b2a:src/moekit/weights/gguf_mxfp4.py > /tmp/old_mxfp4.py
    PYTHONPATH=src .venv/bin/python benchmarks/gguf_mxfp4_miss.py bench-out/scale/gpt-oss-20b.gguf /tmp/old_mxfp4.py
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from moekit.offload.memory import pin_mmap_threshold
from moekit.offload.reader import ExpertReader, gguf_mxfp4_rows
from moekit.weights.gguf_checkpoint import open_gguf
from moekit.weights.gguf_extents import store_manifest
from moekit.weights.gguf_mxfp4 import hub_nibbles_

from gguf_mxfp4_nibbles import other_hub_nibbles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("other", help="another gguf_mxfp4.py (e.g. an older commit's)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pin_mmap_threshold()
    ckpt = open_gguf(args.gguf)
    ckpt = getattr(ckpt, "inner", ckpt)
    manifest, _ = store_manifest(ckpt.gguf, ckpt.spec(), verify=False)
    keys = [(layer, e) for layer in (0, 1) for e in range(4)]
    old_nibbles = other_hub_nibbles(args.other)
    with ExpertReader(args.gguf, manifest, torch.bfloat16) as reader:
        slot = torch.zeros(reader.read_size(), dtype=torch.uint8)  # a slot, already backed
        for key in keys:  # the file's pages into the page cache; both ways give the same rows
            fresh = [t.clone() for t in gguf_mxfp4_rows(reader.read_bytes(*key, verify=False), manifest.experts[key])]
            want = [old_nibbles(t) for t in fresh]
            got = reader.read(*key, verify=False, scratch=slot)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), key

        def before(key):
            rows = gguf_mxfp4_rows(reader.read_bytes(*key, verify=False), manifest.experts[key])
            return [old_nibbles(t) for t in rows]

        def after(key):
            return [hub_nibbles_(t) for t in gguf_mxfp4_rows(reader.read_bytes(*key, verify=False, scratch=slot),
                                                            manifest.experts[key])]

        print("load average:", os.getloadavg())
        times: dict[str, list[float]] = {"before": [], "after": []}
        faults = {name: 0 for name in times}
        for _ in range(args.rounds):
            for key in keys:
                for name, miss in (("before", before), ("after", after)):
                    flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    start = time.perf_counter()
                    miss(key)
                    times[name].append(time.perf_counter() - start)
                    faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt
        nbytes = manifest.experts[keys[0]].nbytes
        for name, ts in times.items():
            print(f"{name}: median {statistics.median(ts) * 1e3:.1f} ms, fastest {min(ts) * 1e3:.1f} ms a miss "
                  f"({nbytes / 1e6:.1f} MB), {faults[name] // len(ts)} minor page faults a miss")
        print("load average:", os.getloadavg())


if __name__ == "__main__":
    main()
