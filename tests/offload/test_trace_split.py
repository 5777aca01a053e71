"""--expert-split's hit curves: a trace of a tiny checkpoint replayed through SlotCache at every slot count."""

from __future__ import annotations

import pytest

from hf_tiny import write_checkpoint
from moekit.analysis.cache_sim import read_trace
from moekit.engine.loader import load_engine
from moekit.engine.trace import trace_model, write_trace
from moekit.offload.policies import make_policy
from moekit.offload.slot_cache import SlotCache
from moekit.offload.trace_split import hit_curves
from offload_files import PROMPTS


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    where = tmp_path_factory.mktemp("split")
    folder = write_checkpoint("qwen3_moe", where / "q", seed=4, num_experts=16, num_experts_per_tok=2)
    engine = load_engine(folder, compile=False)
    try:
        gen = engine.generate(PROMPTS, max_new_tokens=16, stop_ids=())
        write_trace(gen, where / "t.parquet", trace_model(engine.spec, folder))
    finally:
        engine.close()
    return where / "t.parquet"


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_each_curve_is_the_full_replay_at_every_slot_count(trace, policy):
    curves = hit_curves(trace, [0, 1], 16, policy)
    calls = read_trace(trace).calls
    for layer, curve in curves.items():
        assert len(curve) == 17 and curve[0] == 0
        for slots in range(1, 17):  # the replay stops at the layer's distinct experts (14 and 11 here)
            cache = SlotCache(slots, make_policy(policy))
            for needed in calls[layer]:
                cache.call(needed)
            assert curve[slots] == cache.hits, (layer, slots)
        accesses = sum(len(n) for n in calls[layer])
        distinct = len({e for n in calls[layer] for e in n})
        assert curve[16] == accesses - distinct


def test_a_trace_with_other_layers_or_experts_is_one_line(trace):
    from moekit.errors import MoekitError

    with pytest.raises(MoekitError, match="not this model's"):
        hit_curves(trace, [0, 1, 2], 16, "lru")
    with pytest.raises(MoekitError, match="not this model's"):
        hit_curves(trace, [0, 1], 4, "lru")
