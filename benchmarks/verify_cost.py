"""What checking every weight against moekit-experts.json costs a resident load (issue 12, item 6).

    .venv/bin/python benchmarks/verify_cost.py bench-out/ckpt/qwen3_moe-150m --repeats 3

The checkpoint is never written: its files are hard-linked into a temporary folder (copied where
links are impossible) and `moekit checksum`'s manifest goes there. Then `moekit.load` runs with
verify on and off, alternating (the page cache is warm for both after the first), and the script
prints each run, the medians, the bytes checked and zlib.crc32's speed on this machine (the cost
the checks would have if nothing overlapped them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path


def _mirror(src: Path, dest: Path) -> None:
    for p in src.iterdir():
        if p.is_file() and p.name != "moekit-experts.json":
            try:
                os.link(p, dest / p.name)
            except OSError:
                shutil.copyfile(p, dest / p.name)


def crc32_gb_s(nbytes: int = 256 << 20) -> float:
    data = os.urandom(nbytes)
    start = time.perf_counter()
    zlib.crc32(data)
    return nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    import moekit
    from moekit.weights.manifest import checksum_checkpoint
    from moekit.spec import load_spec

    torch.set_num_threads(1)  # as the decode benchmarks: one thread, the other core free for the checks
    with tempfile.TemporaryDirectory(prefix="moekit-verify-") as tmp:
        folder = Path(tmp) / args.checkpoint.name
        folder.mkdir()
        _mirror(args.checkpoint, folder)
        made = checksum_checkpoint(folder, load_spec(str(folder)))
        print(f"moekit checksum: {made.experts} experts + {made.tensors} tensors, {made.nbytes / 1e6:.1f} MB "
              f"in {made.seconds:.2f} s")
        moekit.load(folder, compile=False)  # warm the page cache and torch
        times: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}  # every thread's CPU seconds, the checks' included
        for i in range(args.repeats):
            for verify in ((True, False) if i % 2 == 0 else (False, True)):
                start, start_cpu = time.perf_counter(), time.process_time()
                engine = moekit.load(folder, verify=verify, compile=False)
                times[verify].append(time.perf_counter() - start)
                cpu[verify].append(time.process_time() - start_cpu)
                del engine
                print(f"run {i + 1} verify={verify}: {times[verify][-1]:.2f} s wall, {cpu[verify][-1]:.2f} s CPU")
        on, off = statistics.median(times[True]), statistics.median(times[False])
        on_cpu, off_cpu = statistics.median(cpu[True]), statistics.median(cpu[False])
        speed = crc32_gb_s()
        print(f"median load: verify {on:.2f} s, --no-verify {off:.2f} s, difference {on - off:+.2f} s "
              f"({(on - off) / off:+.1%}); CPU {on_cpu:.2f} s vs {off_cpu:.2f} s ({on_cpu - off_cpu:+.2f} s)")
        print(f"checked {made.nbytes / 1e6:.1f} MB; zlib.crc32 here {speed:.2f} GB/s, so "
              f"{made.nbytes / speed / 1e9:.2f} s if the checks did not overlap the copies")


if __name__ == "__main__":
    main()
