"""The sharded server's per-rank counts (moekit.dist.serving) agree with the exchange's own
arithmetic, the one the simulator uses (moekit.dist.exchange.traffic)."""

from __future__ import annotations

import numpy as np

from moekit.dist.exchange import traffic
from moekit.dist.placement import LayerPlacement, RouteTable
from moekit.dist.serving import balancedness, rank_loads, served_here


class _Layer:  # what the counts read of an ExpertParallelLayer: its route table
    def __init__(self, table):
        self.table = table


def test_loads_and_served_tokens_are_the_exchanges_pairs():
    # 6 experts on 2 ranks, experts 1 and 4 copied onto both: their tokens alternate between copies.
    layer = _Layer(RouteTable.of(LayerPlacement(6, ((0, 1, 2, 4), (3, 4, 5, 1)))))
    ids = np.random.default_rng(0).integers(0, 6, size=(9, 2))  # [T, K]
    for forward in range(3):
        loads = rank_loads(ids, 2, layer, forward)
        assert loads.tolist() == traffic(ids, 2, layer.table, forward).sum(axis=0).tolist()
        served = [served_here(ids, r, layer, forward) for r in range(2)]
        assert (served[0] + served[1]).tolist() == np.bincount(ids.reshape(-1), minlength=6).tolist()
        assert served[0][[3, 5]].sum() == 0 and served[1][[0, 2]].sum() == 0  # each only what it holds
        assert [s.sum() for s in served] == loads.tolist()


def test_balancedness_is_mean_over_max():
    assert balancedness([4, 4]) == 1.0
    assert balancedness([6, 2]) == 4 / 6
    assert balancedness([0, 0]) is None
