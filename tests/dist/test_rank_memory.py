"""A serving follower keeps its experts and nothing else (moekit.dist.rank_memory), on a
checkpoint loaded and sharded as a follower's is; the sharded server's tests check the same in a
real follower process through /metrics, with the tokens exact."""

from __future__ import annotations

import pytest

from moekit.dist.rank_memory import keep_only_experts, weight_bytes
from moekit.dist.group import Rank
from moekit.dist.session import choose_placement, shard
from moekit.engine.loader import load_engine
from moekit.model.experts import RoutedExperts


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_follower_holds_no_dense_weights_and_only_its_experts(tiny_checkpoints, family):
    whole = load_engine(tiny_checkpoints(family), compile=False)
    engine = load_engine(tiny_checkpoints(family), compile=False)
    try:
        everything = weight_bytes(whole.decoder, {})
        sharded = shard(engine, Rank(1, 2), choose_placement(engine, None, 2), timeout_s=1.0)
        before = weight_bytes(engine.decoder, sharded.layers)
        assert before["dense"] == everything["dense"] > 0
        keep_only_experts(engine.decoder, sharded.layers)
        after = weight_bytes(engine.decoder, sharded.layers)
        assert after["dense"] == 0
        assert after["experts"] == before["experts"]
        # half of the routed experts (each weight, each layer; biases stay whole on every rank). The
        # whole decoder's count is by storage, and its stacks may be views into the buffer the loader
        # filled: their own bytes are what half is of.
        routed = sum(t.nbytes for m in whole.decoder.modules() if isinstance(m, RoutedExperts)
                     for t in m.parameters())
        assert 0.45 * routed <= after["experts"] <= 0.55 * routed
        assert not [n for n, _ in engine.decoder.named_parameters() if ".ffn.experts." not in n]
    finally:
        whole.close()
        engine.close()
