"""Trace statistics on hand-built traces whose answers are known: uniform load, one-hot collapse,
two domains on disjoint experts, alternating and repeated experts, a deterministic layer map."""

import math

import numpy as np
import pytest

from moekit.analysis.analyze import analyze
from moekit.analysis.reuse_stats import coactivation_matrix
from moekit.analysis.trace_data import from_table, read_routing_trace
from moekit.errors import MoekitError
from routing_traces import model, sequence, table, write

UNIFORM = [(0, 1), (2, 3), (4, 5), (6, 7)] * 10  # 8 experts, K = 2, every expert 10 times per layer


def _analyze(tokens, experts=8, k=2, params=None):
    return analyze(from_table(table(tokens, model(experts, k))), params)


def test_uniform_load():
    got = _analyze(sequence(UNIFORM))
    for layer in ("0", "1"):
        s = got["layers"][layer]
        assert s["counts"] == [10] * 8
        assert s["max_over_mean"] == 1.0 and s["cv"] == 0.0 and s["unused"] == 0
        assert s["hot10_share"] == pytest.approx(1 / 8)  # the hottest 10% of 8 experts is 1 expert
        assert s["load_entropy_bits"] == pytest.approx(3.0)
        assert s["weight_entropy_bits"] == pytest.approx(1.0)  # two equal weights
        assert s["top1_share_mean"] == pytest.approx(0.5) and s["top1_confident_share"] == 0.0
        assert s["verdict"] == "healthy"
    assert got["overall"]["unhealthy_layers"] == {}
    assert got["reuse"]["0"]["same_experts"] == 0.0 and got["reuse"]["0"]["overlap"] == 0.0


def test_one_hot_collapse():
    got = _analyze(sequence([(0,)] * 40), k=1)  # 4 tokens per expert: enough for a verdict
    s = got["layers"]["0"]
    assert s["hot10_share"] == 1.0 and s["unused"] == 7 and s["max_over_mean"] == 8.0
    assert s["load_entropy_bits"] == 0.0 and s["weight_entropy_bits"] == 0.0
    assert s["top1_confident_share"] == 1.0
    assert s["verdict"] == "collapsed"
    assert got["overall"]["unhealthy_layers"] == {"0": "collapsed", "1": "collapsed"}
    assert got["reuse"]["0"] == {"pairs": 39, "same_experts": 1.0, "overlap": 1.0}
    # one slot holds the only expert: every forward but the first hits, for LRU and Belady alike
    curve = got["hit_rate"]
    assert curve["slots"] == [1, 2, 4, 8]
    assert curve["hit_rate"]["lru"][0] == pytest.approx(39 / 40)
    assert curve["hit_rate"]["belady"] == curve["hit_rate"]["lru"]


def test_no_verdict_below_four_tokens_per_expert():
    got = _analyze(sequence([(0,)] * 31), k=1)  # 8 experts need 32
    assert got["layers"]["0"]["verdict"] == "too few tokens" and got["layers"]["0"]["verdict_min_tokens"] == 32
    assert got["overall"]["unhealthy_layers"] == {} and got["overall"]["too_few_tokens_layers"] == ["0", "1"]


def test_two_domains_on_disjoint_experts_diverge_by_one_bit():
    a = sequence([(0, 1), (2, 3)] * 5, row=0, domain="code")
    b = sequence([(4, 5), (6, 7)] * 5, row=1, domain="prose")
    got = _analyze(a + b)
    spec = got["specialisation"]
    assert spec["domains"] == ["code", "prose"]
    assert spec["js_bits"]["code"]["prose"] == pytest.approx(1.0)
    assert spec["js_bits"]["code"]["code"] == pytest.approx(0.0, abs=1e-12)
    assert spec["usage"]["code"]["0"][:4] == [0.25] * 4 and spec["usage"]["code"]["0"][4:] == [0.0] * 4
    assert spec["tokens"] == {"code": 10, "prose": 10}
    # rows are separate sequences: row 1's first token has no predecessor
    assert got["reuse"]["0"]["pairs"] == 18


def test_half_overlap_and_top1_share():
    got = _analyze(sequence([(0, 1), (0, 2)] * 6, weights=[[0.9, 0.1], [0.6, 0.4]] * 6))
    assert got["reuse"]["0"]["same_experts"] == 0.0
    assert got["reuse"]["0"]["overlap"] == pytest.approx(0.5)
    assert got["layers"]["0"]["top1_confident_share"] == pytest.approx(0.5)  # 0.9 >= 0.85, 0.6 is not
    assert got["layers"]["0"]["top1_share_mean"] == pytest.approx(0.75)
    pairs = got["coactivation"]["0"]["top_pairs"]
    assert [p["experts"] for p in pairs] == [[0, 2], [0, 1]] or [p["experts"] for p in pairs] == [[0, 1], [0, 2]]
    assert all(p["tokens"] == 6 for p in pairs)
    assert pairs[0]["lift"] == pytest.approx(6 * 12 / (12 * 6))


def test_coactivation_counts_equal_the_int64_product():
    # coactivation_matrix counts pairs: the same matrix as the plain onehot.T @ onehot, with tokens
    # of 1 to 3 choices (shorter rows padded; an expert listed twice is read as one)
    rng = np.random.default_rng(1)
    choices = [[int(e) for e in rng.integers(0, 128, size=int(rng.integers(1, 4)))] for _ in range(3000)]
    assert any(len(set(c)) < len(c) for c in choices)
    trace = from_table(table(sequence(choices, weights=[[1.0] * len(c) for c in choices]), model(128, 3)))
    for layer in trace.layers:
        hot = trace.onehot(layer).astype(np.int64)
        got = coactivation_matrix(trace, layer)
        assert got.dtype == np.int64 and np.array_equal(got, hot.T @ hot)
        assert got.trace() == sum(len(set(c)) for c in choices)


def test_layer_choice_predicts_the_next_layer():
    rng = np.random.default_rng(0)
    tokens = []
    for t in range(400):
        e = int(rng.integers(0, 8))
        tokens.append({"position": t, "layer": 0, "ids": [e], "weights": [1.0]})
        tokens.append({"position": t, "layer": 1, "ids": [(e + 3) % 8], "weights": [1.0]})
    got = _analyze(tokens, k=1)["prefetch"]["0->1"]
    assert got["recall_from_previous_layer"] == 1.0
    assert got["recall_most_popular"] < 0.3  # one guess of 8 roughly uniform experts
    assert got["tokens_scored"] == 200


def test_activation_counts_distinct_experts():
    # token 1 ran with one expert (a policy): [3, 3] at weights [1, 0] is one expert, not two
    tokens = sequence([(0, 1), (3, 3), (4, 5)], weights=[[0.5, 0.5], [1.0, 0.0], [0.5, 0.5]])
    got = _analyze(tokens)["activation"]
    assert got["experts_per_token"]["min"] == 2 and got["experts_per_token"]["max"] == 4
    assert got["experts_per_token"]["mean"] == pytest.approx(10 / 3)
    assert got["share"]["max"] == pytest.approx(4 / 16)  # routed experts only: 4 of 2 × 8
    assert got["share_of"] == "routed experts only"


def test_activation_share_with_the_models_parameters():
    from moekit.engine.meter import ParamsPerToken

    params = ParamsPerToken(fixed=100, expert_each={0: 10, 1: 10}, top_k={0: 2, 1: 2}, embedding_row=4,
                            embedding_table=40, head=0, total_params=300)
    got = _analyze(sequence([(0, 1), (3, 3)], weights=[[0.5, 0.5], [1.0, 0.0]]), params=params)["activation"]
    assert got["active_params"]["max"] == 140 + 40 and got["active_params"]["min"] == 140 + 20
    assert got["share"]["mean"] == pytest.approx((180 + 160) / 2 / 300)
    assert set(got["by_position"]) == {"0-15"}


def test_json_is_plain(tmp_path):
    import json

    got = _analyze(sequence(UNIFORM))
    assert json.loads(json.dumps(got))["layers"]["0"]["counts"] == [10] * 8


def test_bad_traces(tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_text("not parquet")
    with pytest.raises(MoekitError, match="not a Parquet trace"):
        read_routing_trace(bad)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"step": [0], "row": [0]}), tmp_path / "cols.parquet")
    with pytest.raises(MoekitError, match="missing column"):
        read_routing_trace(tmp_path / "cols.parquet")
    write(tmp_path / "far.parquet", sequence([(0, 9)]), model(8, 2))
    with pytest.raises(MoekitError, match="another model"):
        read_routing_trace(tmp_path / "far.parquet")
    write(tmp_path / "layer.parquet", sequence([(0, 1)], layers=(0, 5)), model(8, 2))
    with pytest.raises(MoekitError, match="not MoE layers"):
        read_routing_trace(tmp_path / "layer.parquet")
    with pytest.raises(MoekitError, match="no such trace"):
        read_routing_trace(tmp_path / "missing.parquet")


def test_a_trace_without_model_facts_says_what_it_assumed(tmp_path):
    trace = read_routing_trace(write(tmp_path / "old.parquet", sequence(UNIFORM), None))
    assert trace.experts == {0: 8, 1: 8} and "assumed 8" in trace.notes[0]
    assert read_routing_trace(tmp_path / "old.parquet", num_experts=16).experts == {0: 16, 1: 16}
    assert math.isclose(analyze(trace, hit_rate=False)["layers"]["0"]["hot10_share"], 1 / 8)
