"""The RSS sampler of the real-size benchmark: a phase's peak shows memory the process really held."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from moekit.bench.offload_rss import RssSampler, malloc_figures, read_status

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")

MIB = 2**20


def test_a_phase_peak_holds_a_buffer_touched_and_freed_inside_it():
    with RssSampler(interval_s=0.001) as sampler:
        sampler.mark("before")
        buf = np.ones(256 * MIB, dtype=np.uint8)  # every page written: anonymous memory
        sampler.sample()
        del buf
        sampler.mark("freed")
    before, freed = sampler.marks["before"], sampler.marks["freed"]
    assert freed["peak"]["RssAnon"] - before["at"]["RssAnon"] >= 250 * MIB
    assert freed["at"]["RssAnon"] < freed["peak"]["RssAnon"] - 200 * MIB  # gone once freed
    assert sampler.report()["vm_hwm"] >= freed["peak"]["VmRSS"] - MIB  # the kernel's own peak (its counters lag a little)


def test_probes_are_read_with_each_sample_and_a_failing_one_is_left_out():
    held = {}
    sampler = RssSampler(probes={"store_bytes": lambda: held["n"]})
    assert "store_bytes" not in sampler.sample()
    held["n"] = 123
    assert sampler.sample()["store_bytes"] == 123 and sampler.peak["store_bytes"] == 123


def test_the_status_fields_and_the_heap_figures_are_bytes():
    status = read_status()
    assert status["VmRSS"] == status["RssAnon"] + status["RssFile"] + status["RssShmem"]
    heap = malloc_figures()
    if heap:  # glibc
        assert heap["heap_in_use"] + heap["heap_free"] == heap["heap"]
