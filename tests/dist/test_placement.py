"""The planner's three pure functions, the placement file and the replica choice, without torch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moekit.dist.eplb import balanced_packing, rebalance, replicate
from moekit.dist.exchange import dispatch, home_bounds, traffic
from moekit.dist.placement import LayerPlacement, RouteTable, check_placement, linear_placement, read_placement
from moekit.errors import MoekitError


def _skewed(layers: int, experts: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (1000 / np.arange(1, experts + 1)[rng.permuted(np.tile(np.arange(experts), (layers, 1)), axis=1)]).round()


def test_balanced_packing_fills_every_pack_equally_heaviest_first():
    weight = np.array([[9.0, 1, 1, 1, 8, 2]])
    pack, slot = balanced_packing(weight, 2)
    assert np.bincount(pack[0]).tolist() == [3, 3]
    assert pack[0, 0] != pack[0, 4]  # the two heaviest go to different packs
    loads = np.bincount(pack[0], weights=weight[0])
    assert loads.max() - loads.min() <= 2
    for p in range(2):  # slots are 0..per-1 within each pack
        assert sorted(slot[0][pack[0] == p].tolist()) == [0, 1, 2]


def test_replicate_gives_extra_copies_to_the_most_loaded_per_copy():
    phy2log, replica, count = replicate(np.array([[10.0, 1, 4]]), 6)
    assert count[0].tolist() == [3, 1, 2]  # copies to 0 (10 → 5 → 3.3 per copy), then to 2 (4)
    assert phy2log[0, :3].tolist() == [0, 1, 2]
    assert count.sum() == 6
    for e in range(3):  # the copies of each item are numbered 0..count-1
        assert sorted(replica[0][phy2log[0] == e].tolist()) == list(range(count[0, e]))


@pytest.mark.parametrize("ranks,nodes,groups", [(4, 1, 16), (16, 2, 16), (8, 1, 4), (32, 4, 2)])
def test_rebalance_places_every_expert_and_beats_linear_on_skewed_load(ranks, nodes, groups):
    experts, layers = 64, 3
    weight = _skewed(layers, experts)
    physical = experts + ranks
    phy2log, count = rebalance(weight, physical, groups, nodes, ranks)
    assert phy2log.shape == (layers, physical)
    per = physical // ranks
    for l in range(layers):
        assert set(phy2log[l].tolist()) == set(range(experts))
        assert np.bincount(phy2log[l], minlength=experts).tolist() == count[l].tolist()
        share = weight[l] / count[l]  # load of each copy
        plan = np.array([share[phy2log[l, r * per:(r + 1) * per]].sum() for r in range(ranks)])
        lin = weight[l].reshape(ranks, -1).sum(1)
        assert plan.mean() / plan.max() > lin.mean() / lin.max()
    assert (rebalance(weight, physical, groups, nodes, ranks)[0] == phy2log).all()  # deterministic


def test_linear_placement_splits_unevenly_when_it_must():
    p = linear_placement({0: 6}, 4)
    assert p.layers[0].ranks == ((0,), (1, 2), (3,), (4, 5))
    with pytest.raises(MoekitError, match="8 ranks but only 6"):
        linear_placement({0: 6}, 8)


def test_home_chunks_and_dispatch_agree_with_the_traffic_matrix():
    assert home_bounds(7, 4).tolist() == [0, 2, 4, 6, 7]
    layer = LayerPlacement(6, ((0, 1, 2, 4), (3, 4, 5, 1)))
    table = RouteTable.of(layer)
    ids = np.array([[1, 4], [0, 3], [4, 4], [5, 1], [2, 0]])
    matrix = traffic(ids, 2, table, forward=3)
    for h in range(2):
        plan = dispatch(ids, h, 2, table, forward=3)
        assert plan.counts.tolist() == matrix[h].tolist()
        dest = table.owners(plan.experts, np.zeros(len(plan.experts), dtype=np.int64), 0)
        assert set(dest.tolist()) <= {0, 1}
    copies = table.owners(np.array([1, 1, 1, 1]), np.arange(4), forward=0)
    assert copies.tolist() == [0, 1, 0, 1]  # round robin over an expert's copies


def test_placement_files_are_checked(tmp_path):
    p = linear_placement({0: 4, 2: 4}, 2, {"model": "m", "config_sha256": "abc"})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p.to_json()))
    back = read_placement(path)
    assert back.layers == p.layers
    check_placement(back, {0: 4, 2: 4}, 2, {"config_sha256": "abc"}, "p")
    with pytest.raises(MoekitError, match="made for 'm'"):
        check_placement(back, {0: 4, 2: 4}, 2, {"model": "other", "config_sha256": "def"}, "p")
    with pytest.raises(MoekitError, match="covers MoE layers"):
        check_placement(back, {0: 4, 1: 4}, 2, {}, "p")
    with pytest.raises(MoekitError, match="has 8 experts, the placement 4"):
        check_placement(back, {0: 8, 2: 8}, 2, {}, "p")
    doc = p.to_json()
    doc["layers"]["0"]["ranks"] = [[0, 1], [2, 7]]
    path.write_text(json.dumps(doc))
    with pytest.raises(MoekitError, match="places expert 7, but the layer has 4"):
        read_placement(path)
    path.write_text("{}")
    with pytest.raises(MoekitError, match="not a moekit placement"):
        read_placement(path)
