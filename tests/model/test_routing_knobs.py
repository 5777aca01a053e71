"""Router knobs and load control (moekit.model.routing_policies): neutral values give exact
routing (by decision and by generated tokens on tiny checkpoints of two families), seeded noise is
reproducible, cache hits equal a fresh route of the cached key, capacity with drop never gives an
expert more than its capacity, and bad policies are refused with one line."""

from __future__ import annotations

import pytest
import torch
from test_deepseek_v3 import build_reference
from test_routing_policies import FAMILIES, _bias, _logits
from tiny_checkpoints import CASES, load_ours, prompt, write_checkpoint

from moekit.engine.generate import generate
from moekit.errors import MoekitError
from moekit.model.routing import LayerState, PolicyRun, PolicyStats, Smooth, TopK, parse_policy, route, route_policy
from moekit.model.routing_policies import (Capacity, DecisionCache, Gumbel, LoadAware, MinConf, Reset, Split,
                                           Temperature, capacity_of)

NEUTRAL = ["temp:1", "gumbel:0", "gumbel:0:5", "cache:0", "loadaware:0", "minconf:1.01", "capacity:64:drop",
           "capacity:64:reroute", "topk:2", "cache:0+reset:3", "loadaware:0+reset:2"]


def _route(logits, spec, text, rows=1, inputs=None, stats=None, state=None):
    policy = parse_policy(text, model_k=spec.top_k, num_experts=spec.num_experts)
    return route_policy(logits, spec, _bias(spec), policy, state or LayerState(), rows, inputs, stats)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", NEUTRAL)
def test_neutral_values_route_exactly(family, text):
    spec, logits = FAMILIES[family], _logits()
    want = route(logits, spec, _bias(spec))
    got = _route(logits, spec, text, rows=4, inputs=torch.randn(32, 16))
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert torch.equal(got.topk_weights, want.topk_weights)


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_gumbel_noise_is_reproducible_and_changes_choices(family):
    spec, logits = FAMILIES[family], _logits(tokens=64)
    a = _route(logits, spec, "gumbel:1:3")
    b = _route(logits, spec, "gumbel:1:3")
    c = _route(logits, spec, "gumbel:1:4")
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_weights, b.topk_weights)
    assert not torch.equal(a.topk_ids, c.topk_ids)
    assert not torch.equal(a.topk_ids, route(logits, spec, _bias(spec)).topk_ids)


def test_temperature_sharpens_the_combine_without_changing_a_softmax_familys_choice():
    spec, logits = FAMILIES["mixtral"], _logits()
    exact, cold = route(logits, spec), _route(logits, spec, "temp:0.5")
    assert torch.equal(exact.topk_ids, cold.topk_ids)  # softmax is monotone: the same top-K
    assert bool((cold.topk_weights[:, 0] >= exact.topk_weights[:, 0]).all())
    torch.testing.assert_close(cold.topk_weights, route(logits * 2, spec).topk_weights)


def test_minconf_keeps_the_top1_alone_exactly_where_its_probability_over_all_experts_reaches_c():
    spec = FAMILIES["mixtral"]
    logits = torch.tensor([[4.0, 0.0, 0, 0, 0, 0, 0, 0], [1.0, 0.9, 0, 0, 0, 0, 0, 0]])
    p1 = torch.softmax(logits, dim=-1).max(dim=-1).values  # ≈ 0.89, ≈ 0.25
    got = _route(logits, spec, "minconf:0.5")
    assert got.topk_ids[0].tolist() == [0, 0] and got.topk_weights[0].tolist() == [1.0, 0.0]
    assert got.topk_ids[1].tolist() == [0, 1]
    assert float(p1[0]) > 0.5 > float(p1[1])
    assert torch.equal(_route(logits, spec, "minconf:0").topk_ids[:, 0], _route(logits, spec, "topk:1").topk_ids[:, 0])


@pytest.mark.parametrize("family", FAMILIES)
def test_topk_above_k_widens_by_the_familys_own_order(family):
    spec, logits = FAMILIES[family], _logits()
    wide = _route(logits, spec, "topk:8")
    assert all(sorted(row) == list(range(8)) for row in wide.topk_ids.tolist())  # every expert, even past DeepSeek's groups
    if spec.order != "topk_then_score" and spec.n_group == 1:
        assert torch.equal(wide.topk_ids[:, :2], route(logits, spec).topk_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_split_gives_the_top1_w_of_the_combine(family):
    spec, logits = FAMILIES[family], _logits()
    got = _route(logits, spec, "split:3:0.9")
    assert got.topk_ids.shape == (32, 3)
    torch.testing.assert_close(got.topk_weights[:, 0], torch.full((32,), 0.9 * spec.scaling))
    torch.testing.assert_close(got.topk_weights.sum(dim=-1), torch.full((32,), spec.scaling))


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_hits_return_what_a_fresh_route_of_the_cached_key_gives(family):
    spec = FAMILIES[family]
    inputs = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    inputs = torch.cat([inputs, inputs[[1, 3]] * 1.0001])  # tokens 6, 7 quantise like tokens 1, 3
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    logits = inputs @ weight.T + torch.randn(8, 8) * torch.tensor([0.0] * 6 + [1.0] * 2)[:, None]
    stats = PolicyStats()
    got = _route(logits, spec, "cache:16", inputs=inputs, stats=stats)
    assert (stats.cache_lookups, stats.cache_hits) == (8, 2)
    fresh = route(logits, spec, _bias(spec))
    for hit, key in ((6, 1), (7, 3)):
        assert torch.equal(got.topk_ids[hit], fresh.topk_ids[key])
        assert torch.equal(got.topk_weights[hit], fresh.topk_weights[key])
    assert torch.equal(got.topk_ids[:6], fresh.topk_ids[:6])


def test_cache_forgets_the_least_recently_used_and_reset_clears_it():
    spec = FAMILIES["mixtral"]
    inputs = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    seq = inputs[[0, 1, 2, 0]]  # with room for 2, token 0's decision is gone when it comes back
    stats = PolicyStats()
    _route(seq @ torch.randn(16, 8), spec, "cache:2", inputs=seq, stats=stats)
    assert stats.cache_hits == 0
    stats = PolicyStats()
    again = inputs[[0, 0, 0, 0]]
    _route(again @ torch.randn(16, 8), spec, "cache:2+reset:2", inputs=again, stats=stats)
    assert (stats.cache_hits, stats.resets) == (2, 1)  # tokens 1 and 3 hit; the reset before token 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["drop", "reroute"])
def test_capacity_never_gives_an_expert_more_than_its_capacity(family, mode):
    spec, rows, tokens = FAMILIES[family], 16, 5
    logits = _logits(tokens=rows * tokens) + torch.tensor([3.0, 2.0, 0, 0, 0, 0, 0, 0])  # experts 0, 1 overloaded
    stats = PolicyStats()
    got = _route(logits, spec, f"capacity:1.5:{mode}", rows=rows, stats=stats)
    cap = capacity_of(1.5, rows, 2, 8)  # 6: room for 48 of the step's 32 assignments
    ids, kept = got.topk_ids.view(rows, tokens, 2), got.topk_weights.view(rows, tokens, 2) != 0
    for t in range(tokens):
        load = torch.bincount(ids[:, t][kept[:, t]], minlength=8)
        assert int(load.max()) <= cap, load
    assert stats.overflow > 0
    if mode == "drop":
        assert stats.dropped == stats.overflow and stats.rerouted == 0
    else:  # a token holding one expert still finds room among the other 7 (7 × 6 > 31): none dropped
        assert stats.rerouted == stats.overflow and stats.dropped == 0
        assert bool(kept.all()) and bool((ids[..., 0] != ids[..., 1]).all())


def test_load_aware_routing_moves_load_off_overloaded_experts():
    spec, rows, tokens = FAMILIES["mixtral"], 16, 8
    logits = _logits(tokens=rows * tokens) + torch.tensor([2.0, 1.5, 0, 0, 0, 0, 0, 0])

    def overflow(decision):
        ids = decision.topk_ids.view(rows, tokens, 2)
        return sum(int((torch.bincount(ids[:, t].reshape(-1), minlength=8) - 4).clamp_min(0).sum()) for t in range(tokens))

    stats = PolicyStats()
    got = _route(logits, spec, "loadaware:0.8", rows=rows, stats=stats)
    assert overflow(got) < overflow(route(logits, spec)) == stats.overflow
    assert stats.penalised > 0


def test_reset_is_the_inner_policy_started_afresh_every_n_tokens():
    spec, logits = FAMILIES["mixtral"], _logits(tokens=8)
    whole = route_policy(logits, spec, None, Reset(4, Smooth(0.9)), LayerState(), rows=1)
    halves = [route_policy(logits[i : i + 4], spec, None, Smooth(0.9), LayerState(), rows=1) for i in (0, 4)]
    assert torch.equal(whole.topk_ids, torch.cat([h.topk_ids for h in halves]))
    state, stats = LayerState(), PolicyStats()  # one token at a time, as decode steps come
    steps = [route_policy(logits[t : t + 1], spec, None, Reset(4, Smooth(0.9)), state, 1, None, stats) for t in range(8)]
    assert torch.equal(whole.topk_ids, torch.cat([s.topk_ids for s in steps])) and stats.resets == 1


@pytest.mark.parametrize("text,want", [("temp:0.85", Temperature(0.85)), ("gumbel:0.2", Gumbel(0.2)),
                                       ("gumbel:0.2:7", Gumbel(0.2, 7)), ("minconf:0.15", MinConf(0.15)),
                                       ("split:3:0.9", Split(3, 0.9)), ("cache:256", DecisionCache(256)),
                                       ("cache:64:0.25", DecisionCache(64, 0.25)), ("loadaware:0.8", LoadAware(0.8)),
                                       ("capacity:1.25:drop", Capacity(1.25)),
                                       ("capacity:1.25:reroute", Capacity(1.25, True)), ("topk:6", TopK(6)),
                                       ("ema:0.95+reset:512", Reset(512, Smooth(0.95))),
                                       ("reset:64+cache:32", Reset(64, DecisionCache(32)))])
def test_parse(text, want):
    assert parse_policy(text, model_k=2, num_experts=8) == want
    assert parse_policy(str(want), model_k=2, num_experts=8) == want


@pytest.mark.parametrize("text,says", [("temp:0", "above 0"), ("temp:x", "not a number"), ("gumbel:-1", "at least 0"),
                                       ("split:9:0.9", "2..8"), ("split:3:1.5", "[0, 1]"), ("cache:-2", "whole number"),
                                       ("capacity:1.25:spill", "'drop' or 'reroute'"), ("topk:9", "1..8"),
                                       ("temp:0.85+reset:5", "keeps no state"), ("ema+reset:0", "whole number"),
                                       ("ema+cache:3", "one stateful policy and reset:N")])
def test_bad_knobs_say_what_is_wrong(text, says):
    with pytest.raises(MoekitError) as err:
        parse_policy(text, model_k=2, num_experts=8)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """Two families with different routing: qwen3_moe (softmax, renormalised top-2) and deepseek_v3
    (sigmoid, selection bias, group-limited top-4 of 16, routed scaling)."""
    qwen = next(c for c in CASES if c.family == "qwen3_moe")
    folder = tmp_path_factory.mktemp("qwen3")
    write_checkpoint(qwen, folder)
    deepseek = tmp_path_factory.mktemp("deepseek_v3")
    build_reference("normalized", seed=0).save_pretrained(deepseek)
    return {"qwen3_moe": load_ours(folder), "deepseek_v3": load_ours(deepseek)}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_neutral_knobs_generate_exact_routings_tokens(decoders, family):
    decoder = decoders[family]
    rows = [(prompt(s, 12)[0] % 90).tolist() for s in range(3)]  # within both vocabularies
    with torch.inference_mode():
        want = generate(decoder, rows, 10, record_routing=False).token_ids
        k = max(spec.ffn.top_k for spec in decoder.spec.layers if spec.ffn is not None and hasattr(spec.ffn, "top_k"))
        for text in NEUTRAL[:-3] + ["loadaware:0+reset:4"]:
            policy = parse_policy(text, model_k=k, num_experts=64)
            assert generate(decoder, rows, 10, record_routing=False, policy=policy).token_ids == want, text
        noisy = [generate(decoder, rows, 10, record_routing=False, policy=Gumbel(2.0, 1)).token_ids for _ in range(2)]
    assert noisy[0] == noisy[1] and noisy[0] != want
