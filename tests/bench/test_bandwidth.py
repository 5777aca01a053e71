"""The roofline's bandwidth: real readings of this machine, and the rule that combines them."""

from __future__ import annotations

import math

import torch

from moekit.bench.bandwidth import largest_reading, product_read_bandwidth, threaded_read_bandwidth
from moekit import ops


def test_a_threaded_read_is_a_finite_rate_of_this_machine():
    rate = threaded_read_bandwidth(n_bytes=32 << 20, readings=2)
    assert math.isfinite(rate) and 1e8 < rate < 1e13  # between 0.1 GB/s and 10 TB/s: any CPU's memory


def test_the_products_read_is_a_rate_once_the_operators_are_registered():
    assert ops.load().ok, ops.load().failures()  # the set-up installs a compiler
    rate = product_read_bandwidth(n_bytes=32 << 20, readings=2)
    assert rate is not None and math.isfinite(rate) and 1e8 < rate < 1e13


def test_the_roofline_takes_the_largest_reading_and_names_the_others():
    bw, line = largest_reading({"numpy": 20e9, "torch sum at 2 threads": 31e9, "product at 2 threads": 27e9})
    assert bw == 31e9 and line.startswith("measured: torch sum at 2 threads, best of")
    assert "numpy: 20.0 GB/s" in line and "product at 2 threads: 27.0 GB/s" in line
    bw, line = largest_reading({"numpy": 20e9, "torch": 12e9, "product": None})  # not taken: left out
    assert bw == 20e9 and line.startswith("measured: numpy") and "torch: 12.0 GB/s" in line and "product" not in line
    bw, line = largest_reading({"torch sum at 4 threads": 9e9, "product": None})
    assert bw == 9e9 and "(" not in line
