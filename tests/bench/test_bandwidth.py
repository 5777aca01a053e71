"""The roofline's bandwidth: a real reading of this machine, and the rule that combines two."""

from __future__ import annotations

import math

import torch

from moekit.bench.bandwidth import larger_reading, threaded_read_bandwidth


def test_a_threaded_read_is_a_finite_rate_of_this_machine():
    rate = threaded_read_bandwidth(n_bytes=32 << 20, readings=2)
    assert math.isfinite(rate) and 1e8 < rate < 1e13  # between 0.1 GB/s and 10 TB/s: any CPU's memory


def test_the_roofline_takes_the_larger_reading_and_names_both():
    bw, line = larger_reading(single=20e9, threaded=31e9, threads=2)
    assert bw == 31e9 and "torch sum at 2 threads" in line and "20.0 GB/s" in line
    bw, line = larger_reading(single=20e9, threaded=12e9, threads=torch.get_num_threads())
    assert bw == 20e9 and line.startswith("measured: numpy") and "12.0 GB/s" in line
