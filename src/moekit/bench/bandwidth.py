"""The memory bandwidth a decode benchmark's roofline divides by: what this machine streams from
memory with the threads the benchmark runs, taken as the best of several readings.

Why not the calculator's `local` probe alone: it times numpy, which sums and copies on one thread,
while the products of a 2-thread decode step read with both cores. Against that one-thread figure
the products reached 111-149% of their "roofline" (session 11, AMD EPYC); the roofline must be a
bound, so it takes the larger of the calculator's reading and a torch sum over the same bytes at
the benchmark's thread count, each the best of READINGS (one reading swings with the machine's load).
"""

from __future__ import annotations

import time

READ_BYTES = 256 * 1024**2  # far past the last-level cache (32 MB on the machines measured)
READINGS = 5


def threaded_read_bandwidth(n_bytes: int = READ_BYTES, readings: int = READINGS) -> float:
    """bytes/s of torch summing an fp32 tensor of n_bytes at torch's current thread count: the
    best of `readings` after one to fault the pages in and start the thread pool."""
    import torch

    data = torch.ones(n_bytes // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(readings):
        began = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - began)
    return data.nbytes / max(best, 1e-9)


def roofline_bandwidth() -> tuple[float, str]:
    """(bytes/s, how it was known): the calculator's `local` probe (numpy, one thread) and
    threaded_read_bandwidth at the benchmark's threads, measured now, combined by larger_reading."""
    import torch

    from moekit.calc.probe import measure_bandwidth

    return larger_reading(measure_bandwidth(repeats=READINGS), threaded_read_bandwidth(), torch.get_num_threads())


def larger_reading(single: float, threaded: float, threads: int) -> tuple[float, str]:
    """The larger of the one-thread numpy reading and the torch reading at `threads`, and a line
    that names it and gives the other."""
    if threaded >= single:
        return threaded, f"measured: torch sum at {threads} threads, best of {READINGS} (numpy, 1 thread: {single / 1e9:.1f} GB/s)"
    return single, f"measured: numpy copy/sum, best of {READINGS} (torch sum at {threads} threads: {threaded / 1e9:.1f} GB/s)"
