"""Reading a real-size model's experts from its GGUF: serial vs a thread pool, cold page cache.

    .venv/bin/python benchmarks/expert_reads_real_size.py big/qwen3-30b-a3b-q8_0.gguf --experts 48

For each mode the file's pages are dropped from the page cache first (posix_fadvise DONTNEED, this
file only), then `--experts` distinct (layer, expert) pairs are read with the store's ExpertReader
(os.preadv), one after another or from N threads at once; MB/s and ms per expert are printed, with
`uptime` (the machine is shared). Then the CPU cost of turning one read into the store's layout
(ExpertReader.read, page cache warm). Nothing here is imported by moekit.
"""
import argparse
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from moekit.offload.reader import ExpertReader
from moekit.spec.loading import spec_from_gguf
from moekit.weights.gguf_extents import store_manifest
from moekit.weights.gguf_file import read_gguf


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--threads", default="1,2,4")
    args = ap.parse_args()
    spec = spec_from_gguf(args.gguf)
    manifest, _ = store_manifest(read_gguf(args.gguf), spec, verify=False)
    reader = ExpertReader(args.gguf.parent, manifest, torch.bfloat16)
    keys = sorted(manifest.experts)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"{len(keys)} experts of {reader.expert_disk_bytes(*keys[0]) / 1e6:.2f} MB")
    step = len(keys) // (args.experts * 4)
    for i, n in enumerate(int(t) for t in args.threads.split(",")):
        picked = keys[i * args.experts * step // 1 + 1::step][: args.experts]  # distinct per mode
        drop_cache(args.gguf)
        total = sum(reader.expert_disk_bytes(*k) for k in picked)
        t0 = time.perf_counter()
        if n == 1:
            for k in picked:
                reader.read_bytes(*k, verify=False)
        else:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda k: reader.read_bytes(*k, verify=False), picked))
        s = time.perf_counter() - t0
        print(f"threads {n}: {len(picked)} experts, {total / s / 1e6:.0f} MB/s, {s / len(picked) * 1e3:.1f} ms per expert")
    k = picked[0]
    reader.read(*k, verify=False)
    t0 = time.perf_counter()
    for _ in range(5):
        reader.read(*k, verify=False)
    print(f"read() into the store's layout, page cache warm: {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms per expert")
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
