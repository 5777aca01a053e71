"""The nibble reorder of one gpt-oss-20b MXFP4 expert (moekit.weights.gguf_mxfp4.hub_nibbles_), which the
paged store pays on every miss of a gpt-oss GGUF and the resident load once per expert: the working
tree's against another version of that module, alternated in one process, one thread, same bytes.
Nothing here is imported by moekit.

    git show a890b2a:src/moekit/weights/gguf_mxfp4.py > /tmp/old_mxfp4.py
    PYTHONPATH=src .venv/bin/python benchmarks/gguf_mxfp4_nibbles.py /tmp/old_mxfp4.py

Prints the median and the fastest of each over --rounds rounds, and `uptime` (the machine is shared);
and the minor page faults of one expert's reorder (getrusage), a count the machine's load does not move.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import time

import numpy as np
import torch

from moekit.offload.memory import pin_mmap_threshold
from moekit.weights.gguf_mxfp4 import hub_nibbles_

# gpt-oss-20b: D = F = 2880, so an expert is gate_up [2F, D/32 · 17] and down [D, F/32 · 17] bytes.
SHAPES = ((5760, 90 * 17), (2880, 90 * 17))


def other_hub_nibbles(path: str):
    """hub_nibbles_ of another gguf_mxfp4.py (e.g. an older commit's), loaded from its file."""
    spec = importlib.util.spec_from_file_location("other_gguf_mxfp4", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hub_nibbles_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", help="another gguf_mxfp4.py (e.g. an older commit's)")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pin_mmap_threshold()  # as the expert store's process does (moekit.offload.attach): a miss's conditions
    rng = np.random.default_rng(0)
    experts = [torch.from_numpy(rng.integers(0, 256, size=s, dtype=np.uint8)) for s in SHAPES]
    runs = {"other": other_hub_nibbles(args.other), "this tree": hub_nibbles_}
    for x in experts:
        assert torch.equal(runs["other"](x.clone()), runs["this tree"](x.clone())), "the two give other bytes"
    print("uptime:", os.getloadavg())
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, f in runs.items():
            copies = [x.clone() for x in experts]
            start = time.perf_counter()
            for x in copies:
                f(x)
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        copies = [x.clone() for x in experts]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for x in copies:
            runs[name](x)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        print(f"{name}: median {statistics.median(ts) * 1e3:.1f} ms, fastest {min(ts) * 1e3:.1f} ms an expert "
              f"(13.2 MB); {faults} minor page faults")
    print("uptime:", os.getloadavg())


if __name__ == "__main__":
    main()
