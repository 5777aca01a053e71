"""moekit::experts_mxfp4 with R bf16 rows that all chose the same 4 experts (one expert's rows in
one call, as at c = 4 or in a prompt), at gpt-oss-20b's gate_up shape [5760, 2880], the weight read
from memory (two sets of 4 experts, 2 x 35 MB, alternated past the last-level cache): ns a weight
block (17 bytes) for R = 1, 2, 3, 4, 8, 16. One line a run; run it on two trees alternately to
compare their builds (each tree's operators are built and cached by its own csrc/):

    for i in 1 2 3; do
      PYTHONPATH=/path/to/before/src .venv/bin/python benchmarks/mxfp4_few_rows.py 1
      PYTHONPATH=$PWD/src .venv/bin/python benchmarks/mxfp4_few_rows.py 1
    done
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from moekit import ops

D, F2, E, TOP = 2880, 5760, 8, 4


def main() -> None:
    assert ops.load().ok
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (E, F2, D // 32, 17), dtype=torch.uint8, generator=gen)
    w[..., 0] = 122  # every block scaled 2^-6
    w = w.view(E, F2, -1)
    run = ops.op("moekit", "experts_mxfp4")
    blocks = TOP * F2 * D // 32
    line = []
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 8, 16):
            x = torch.randn(rows, 1, D, generator=gen).to(torch.bfloat16)
            picks = [torch.arange(TOP).repeat(rows, 1) + TOP * k for k in range(2)]
            run(x, w, picks[0])
            times = []
            for i in range(10):
                t = time.perf_counter()
                run(x, w, picks[i % 2])
                times.append(time.perf_counter() - t)
            s = statistics.median(times)
            line.append(f"R={rows}: {s * 1e3:.2f} ms {s / blocks * 1e9:.3f} ns/wblock")
    print(" | ".join(line))


if __name__ == "__main__":
    main()
