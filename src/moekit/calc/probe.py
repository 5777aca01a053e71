"""`local`: this machine's memory bandwidth and matmul rate, measured in about a second.

Bandwidth: best of a few runs of a numpy copy (counted as read + write, STREAM's convention) and
a numpy sum (read only) over an array far larger than any cache. Peak FLOPs: best of a few numpy
float32 matmuls (2·n³ FLOPs each); numpy has no bf16, so only the fp32 rate is known, and a plan
at another dtype says it is bounded by that fp32 rate (what a CPU without bf16 matmul units reaches). Capacity: physical RAM from os.sysconf.
"""

from __future__ import annotations

import os
import time

from moekit.calc.hardware import Hardware

PROBE_BYTES = 256 * 1024**2
MATMUL_N = 1024
REPEATS = 3


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_bandwidth(n_bytes: int = PROBE_BYTES, repeats: int = REPEATS) -> float:
    import numpy as np

    src = np.ones(n_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    copy_rate = 2 * src.nbytes / best_seconds(lambda: np.copyto(dst, src), repeats)
    sum_rate = src.nbytes / best_seconds(lambda: src.sum(), repeats)
    return max(copy_rate, sum_rate)


def measure_matmul_flops(n: int = MATMUL_N, repeats: int = REPEATS) -> float:
    import numpy as np

    a = np.ones((n, n), dtype=np.float32)
    b = np.ones((n, n), dtype=np.float32)
    a @ b  # first call pays for thread start-up
    return 2 * n**3 / best_seconds(lambda: a @ b, repeats)


def memory_capacity() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe_local() -> Hardware:
    flops = measure_matmul_flops()
    return Hardware(
        name="local",
        label=f"this machine ({os.cpu_count()} CPUs, measured)",
        memory_bytes=memory_capacity(),
        bandwidth=measure_bandwidth(),
        flops=(("fp32", flops),),  # the dtype measured; a bf16 plan then names the fp32 rate it is bounded by
        source="measured now: numpy copy/sum bandwidth, numpy fp32 matmul, os.sysconf RAM",
        measured=True,
    )
