"""The memory bandwidth a decode benchmark's roofline divides by: what this machine streams from
memory with the threads the benchmark runs, taken as the best of several readings.

Why not the calculator's `local` probe alone: it times numpy, which sums and copies on one thread,
while the products of a 2-thread decode step read with both cores. Against that one-thread figure
the products reached 111-149% of their "roofline" (session 11, AMD EPYC); the roofline must be a
bound, so it takes the largest of the calculator's reading, a torch sum over the same bytes at the
benchmark's thread count, and, where this process has the gemv operators registered, moekit's own
one-row fp32 product over as many bytes, each the best of READINGS (one reading swings with the
machine's load). Why the third: on an Intel Xeon with AMX (session 17) the torch sum read 19-33 GB/s
from run to run and numpy 24-27, while the one-row product streamed 30-36 GB/s, so decode steps
measured 106-121% of a roofline made of the first two.
"""

from __future__ import annotations

from typing import Optional

from moekit.calc.probe import best_seconds, measure_bandwidth

READ_BYTES = 256 * 1024**2  # past the last-level cache of most machines measured (32 MB), not all (480 MB)
READINGS = 5
_PRODUCT_WIDTH = 1024  # the product's inputs: a weight of READ_BYTES as rows this long


def threaded_read_bandwidth(n_bytes: int = READ_BYTES, readings: int = READINGS) -> float:
    """bytes/s of torch summing an fp32 tensor of n_bytes at torch's current thread count: the
    best of `readings` after one to fault the pages in and start the thread pool."""
    import torch

    data = torch.ones(n_bytes // 4, dtype=torch.float32)
    return data.nbytes / _best_seconds(lambda: data.sum(), readings)


def product_read_bandwidth(n_bytes: int = READ_BYTES, readings: int = READINGS) -> Optional[float]:
    """bytes/s of moekit's one-row fp32 product (moekit::rows_gemv, the build and grouping the
    compiled step chooses for fp32) over an fp32 weight of n_bytes, at torch's thread count: the best
    of `readings` after one. None where this process has not loaded the operators (`--kernels
    reference`, a failed build)."""
    import torch

    from moekit import ops

    if not ops.available("rows_gemv"):
        return None
    v = ops.variant("float32")
    product = ops.op(v.namespace, "rows_gemv")
    weight = torch.ones(n_bytes // 4 // _PRODUCT_WIDTH, _PRODUCT_WIDTH)
    x = torch.ones(1, _PRODUCT_WIDTH)
    return weight.nbytes / _best_seconds(lambda: product(x, weight, v.grouped), readings)


def _best_seconds(call, readings: int) -> float:
    """The best of `readings` timed calls, after one to fault pages in and start the thread pool."""
    call()
    return best_seconds(call, readings)


def roofline_bandwidth() -> tuple[float, str]:
    """(bytes/s, how it was known): the calculator's `local` probe (numpy, one thread),
    threaded_read_bandwidth and product_read_bandwidth at the benchmark's threads, measured now,
    combined by largest_reading."""
    import torch

    threads = torch.get_num_threads()
    return largest_reading({
        "numpy copy/sum, 1 thread": measure_bandwidth(repeats=READINGS),
        f"torch sum at {threads} threads": threaded_read_bandwidth(),
        f"moekit's one-row fp32 product at {threads} threads": product_read_bandwidth(),
    })


def largest_reading(readings: dict[str, Optional[float]]) -> tuple[float, str]:
    """The largest of the readings (name → bytes/s; None: not taken here), and a line that names
    it and gives the others."""
    taken = {name: rate for name, rate in readings.items() if rate is not None}
    best = max(taken, key=taken.get)
    others = ", ".join(f"{name}: {rate / 1e9:.1f} GB/s" for name, rate in taken.items() if name != best)
    return taken[best], f"measured: {best}, best of {READINGS}" + (f" ({others})" if others else "")
