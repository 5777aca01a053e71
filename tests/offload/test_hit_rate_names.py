"""`hit_rate` and `decode_hit_rate`: one name, one meaning in ExpertStore.stats(), `moekit run --json`
and cache-sim (issue 15). hit_rate counts every forward, the prompt pass included; decode_hit_rate
the decode steps alone."""

from __future__ import annotations

import json

import pytest

from cli_runner import moekit
from hf_tiny import write_checkpoint
from moekit.engine.loader import load_engine
from moekit.engine.trace import trace_model, write_trace
from moekit.analysis.cache_sim import read_trace, result_dict, simulate
from moekit.offload.options import OffloadOptions

PROMPT = [5, 17, 42, 9, 77, 3, 101, 8, 64, 12]
NEW = 16


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen_rates"), seed=1)


@pytest.fixture(scope="module")
def live(qwen, tmp_path_factory):
    """(store.stats() after one generation, the path of its trace)."""
    engine = load_engine(qwen, offload=OffloadOptions("50%", policy="lru", prefetch=False), compile=False)
    try:
        gen = engine.generate(PROMPT, max_new_tokens=NEW, stop_ids=())
        stats = engine.store.stats()
        path = tmp_path_factory.mktemp("rates") / "t.parquet"
        write_trace(gen, path, trace_model(engine.spec, qwen))
    finally:
        engine.close()
    return stats, path


def test_the_store_reports_both_and_they_differ_by_the_prompt_pass(live):
    stats, _ = live
    overall = sum(l["hits"] for l in stats["layers"].values()) / sum(l["accesses"] for l in stats["layers"].values())
    assert stats["hit_rate"] == pytest.approx(overall)
    assert stats["decode_hit_rate"] is not None and stats["decode_hit_rate"] != stats["hit_rate"]


def test_the_store_and_cache_sim_agree_name_by_name(live):
    stats, path = live
    sim = result_dict(simulate(read_trace(path), "lru", stats["slots_per_layer"]), read_trace(path), None)
    assert sim["hit_rate"] == pytest.approx(stats["hit_rate"])
    assert sim["decode_hit_rate"] == pytest.approx(stats["decode_hit_rate"])


def test_run_json_uses_the_same_names_and_meanings(capsys, qwen, live):
    stats, _ = live
    code, out, err = moekit(capsys, "run", "--eager", qwen, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
                            str(NEW), "--stop", "", "--expert-memory", "50%", "--json")
    assert code == 0, err
    report = json.loads(out)["offload"]
    assert report["hit_rate"] == pytest.approx(stats["hit_rate"])
    assert report["decode_hit_rate"] == pytest.approx(stats["decode_hit_rate"])
