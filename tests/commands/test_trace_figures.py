"""Figures read from a routing trace of the bundled model (issue 42, items 2, 3 and 7): `analyze` gives
no verdict from too few tokens and says what its verdicts mean when it gives them; `cache-sim` counts
the prompt's misses apart and no per-token figure exceeds what a token can touch (K per MoE layer);
`placement` puts a replica on a rank that lacks its expert and scores the plan on held-out tokens too."""

from __future__ import annotations

import json

import pytest

from cli_runner import moekit

LAYERS, EXPERTS, K = 4, 128, 2  # the bundled model (models/moekit-demo/config.json)
PROSE = ("The river runs past the mill and under the old stone bridge, where the children count boats. "
         "In the evening the baker closes his shop, the lamps come on, and the town grows quiet. ")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Traces as `moekit run PROMPT --max-new-tokens 4 --trace` writes them: a one-line prompt, and a
    2,000-character one."""
    from moekit.engine.default_model import bundled_model_path
    from moekit.engine.loader import load_engine
    from moekit.engine.trace import trace_model, write_trace

    folder = tmp_path_factory.mktemp("traces")
    engine = load_engine(bundled_model_path(), compile=False)
    paths = {}
    for name, prompt in (("short", "def parse_args(argv):"), ("long", (PROSE * 20)[:2000])):
        paths[name] = folder / f"{name}.parquet"
        gen = engine.generate(engine.encode(prompt), max_new_tokens=4, stop_ids=())
        write_trace(gen, paths[name], trace_model(engine.spec, engine.folder))
    engine.close()
    return paths


def test_analyze_gives_no_verdict_from_a_few_tokens(capsys, traces):
    code, out, err = moekit(capsys, "analyze", traces["short"], "--no-hit-rate")
    assert code == 0, err
    assert "too few tokens for a verdict (n=" in out and f"need ≥ 4 × {EXPERTS} experts = {4 * EXPERTS}" in out
    assert "collapsed" not in out and "skewed" not in out
    stats = json.loads(moekit(capsys, "analyze", traces["short"], "--no-hit-rate", "--json")[1])
    assert all(s["verdict"] == "too few tokens" for s in stats["layers"].values())
    assert stats["overall"]["unhealthy_layers"] == {}


def test_analyze_gives_verdicts_from_enough_tokens_and_says_what_they_mean(capsys, traces):
    stats = json.loads(moekit(capsys, "analyze", traces["long"], "--no-hit-rate", "--json")[1])
    assert all(s["tokens"] >= 4 * EXPERTS for s in stats["layers"].values()), "the long prompt is too short"
    assert all(s["verdict"] in ("healthy", "skewed", "collapsed") for s in stats["layers"].values())
    out = moekit(capsys, "analyze", traces["long"], "--no-hit-rate")[1]
    assert "collapsed: the hottest 10% of experts serve" in out and "too few tokens" not in out


@pytest.mark.parametrize("slots", ["2", "25%", "100%"])
def test_cache_sim_keeps_the_prompts_misses_apart_and_within_their_bound(capsys, traces, slots):
    code, out, err = moekit(capsys, "cache-sim", traces["long"], "--slots", slots, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["max_misses_per_decoded_token"] == LAYERS * K
    assert report["decode_tokens"] == 3  # 4 generated: the prefill's, then 3 decode steps
    for r in report["results"]:
        assert r["prefill_misses"] + r["decode_misses"] == r["misses"]
        assert 0 <= r["decode_misses_per_token"] <= LAYERS * K
        assert r["prefill_misses"] > LAYERS * K  # a long prompt touches many experts: kept out of the per-token figure


def test_cache_sim_table_names_the_bound(capsys, traces):
    code, out, _ = moekit(capsys, "cache-sim", traces["long"], "--slots", "2")
    assert code == 0
    assert "prefill misses" in out and "at most 8: K experts in each MoE layer" in out


@pytest.mark.parametrize("ranks, redundant", [(4, 8), (4, 4), (8, 8), (2, 2)])
def test_placement_puts_no_two_copies_of_an_expert_on_one_rank(capsys, traces, ranks, redundant):
    code, out, err = moekit(capsys, "placement", traces["long"], "--ranks", ranks, "--redundant", redundant, "--json")
    assert code == 0, err
    doc = json.loads(out)
    for layer, plan in doc["layers"].items():
        for rank, held in enumerate(plan["ranks"]):
            assert len(held) == len(set(held)), f"layer {layer} rank {rank} holds {held}"
        assert sum(len(h) for h in plan["ranks"]) == EXPERTS + redundant


def test_placement_scores_the_plan_on_tokens_it_was_not_fitted_to(capsys, traces):
    doc = json.loads(moekit(capsys, "placement", traces["long"], "--ranks", "4", "--redundant", "8", "--json")[1])
    assert 0 < doc["heldout_tokens"] < 2000  # the last part of the long prompt's tokens
    held, fitted = doc["balancedness_heldout"], doc["balancedness"]
    assert 0 < held["plan"] <= 1 and 0 < fitted["plan"] <= 1 and 0 < held["linear"] <= 1
    out = " ".join(moekit(capsys, "placement", traces["long"], "--ranks", "4", "--redundant", "8")[1].split())
    assert "plan, fitted" in out and "plan, held-out" in out and "scored on the last" in out
