"""dbrx's experts (rows e·F..(e+1)·F of [E·F, D] tensors, down applied x @ W) paged by the expert
store: any budget generates exactly what the resident engine generates."""

from __future__ import annotations

import pytest

from hf_tiny import write_checkpoint
from moekit.offload.options import OffloadOptions
from offload_files import greedy_runs


def _ids(folder, offload=None, dtype="float32"):
    return greedy_runs(folder, offload, dtype, new=12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dbrx_paged_at_the_minimum_budget_is_the_resident_run(tmp_path, dtype):
    folder = write_checkpoint("dbrx", tmp_path / "dbrx", seed=2)  # 6 experts, K = 2
    want = _ids(folder, dtype=dtype)[:2]
    for options in (OffloadOptions("34%"), OffloadOptions("34%", policy="none"), OffloadOptions("50%", prefetch=True)):
        single, batch, stats = _ids(folder, options, dtype)
        assert (single, batch) == want, options
        assert stats["loads"] > 0 and stats["hit_rate"] < 1
