"""cache-sim reads the model's facts from the trace (issue 15): shares of the real expert count,
never of the highest id a short trace happens to reach, and slots capped at the experts there are."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli_runner import moekit, refused
from moekit.engine.trace import METADATA_KEY, TraceModel, read_trace_model
from moekit.offload.budget import parse_budget, plan_slots

E, K = 128, 2


def _trace(path, rows, model: TraceModel | None):
    """A routing trace by hand: rows of (step, row, layer, expert_ids), with or without the metadata."""
    table = pa.table({
        "step": pa.array([r[0] for r in rows], pa.int32()),
        "row": pa.array([r[1] for r in rows], pa.int32()),
        "layer": pa.array([r[2] for r in rows], pa.int32()),
        "expert_ids": pa.array([r[3] for r in rows], pa.list_(pa.int32())),
    })
    if model is not None:
        table = table.replace_schema_metadata({METADATA_KEY: json.dumps(model.to_json()).encode()})
    pq.write_table(table, path)
    return path


# Four decode steps over 2 layers that never reach an id above 122 (of 128).
ROWS = [(s, 0, l, [s * 7 % 100, 122 - s]) for s in range(4) for l in (0, 1)]
MODEL = TraceModel("toy", "qwen3_moe", 2, {0: E, 1: E}, {0: K, 1: K}, "ab" * 32)


def sim(capsys, *args):
    code, out, err = moekit(capsys, "cache-sim", *args, "--policy", "lru", "--json")
    assert code == 0, err
    return json.loads(out)


def fails(capsys, *args) -> str:
    return refused(capsys, "cache-sim", *args)


def test_a_share_is_of_the_models_experts_as_a_live_budget_makes_it(capsys, tmp_path):
    path = _trace(tmp_path / "t.parquet", ROWS, MODEL)
    report = sim(capsys, path, "--slots", "25%,12.5%")
    assert report["num_experts"] == E and report["model"]["moe_layers"]["0"] == {"num_experts": E, "top_k": K}
    expert_bytes, layers = 1000, 2
    live = [plan_slots(parse_budget(share, E * expert_bytes * layers), expert_bytes, layers, E, K).slots
            for share in ("12.5%", "25%")]
    assert [r["slots"] for r in report["results"]] == live == [16, 32]  # not 15 and 30 (123 × share)


def test_more_slots_than_experts_are_capped_with_a_note(capsys, tmp_path):
    path = _trace(tmp_path / "t.parquet", ROWS, MODEL)
    report = sim(capsys, path, "--slots", "200,64")
    assert [(r["slots"], r["slots_share"]) for r in report["results"]] == [(64, 0.5), (128, 1.0)]
    assert any("--slots 200: capped at 128" in n for n in report["notes"])
    code, out, _ = moekit(capsys, "cache-sim", path, "--slots", "200", "--policy", "lru")
    assert code == 0 and "156%" not in out and "capped at 128" in " ".join(out.split())


def test_an_older_trace_counts_slots_but_refuses_a_share_it_cannot_know(capsys, tmp_path):
    path = _trace(tmp_path / "old.parquet", ROWS, None)
    err = fails(capsys, path, "--slots", "25%")
    assert "--num-experts" in err and "does not record" in err
    counted = sim(capsys, path, "--slots", "4")
    assert counted["num_experts"] is None and counted["results"][0]["slots_share"] is None
    told = sim(capsys, path, "--slots", "25%", "--num-experts", E)
    assert told["results"][0]["slots"] == 32


def test_a_num_experts_the_trace_contradicts_is_refused(capsys, tmp_path):
    path = _trace(tmp_path / "t.parquet", ROWS, MODEL)
    assert "toy, which has 128 experts per layer" in fails(capsys, path, "--num-experts", 123)
    small = _trace(tmp_path / "small.parquet", ROWS, TraceModel("toy", "qwen3_moe", 2, {0: 64, 1: 64}, {0: K, 1: K}, None))
    assert "routes to expert 122, but toy has 64" in fails(capsys, small)


def test_run_writes_the_models_facts_into_the_trace(capsys, tmp_path):
    from moekit.engine.default_model import bundled_model_path

    path = tmp_path / "t.parquet"
    code, _, err = moekit(capsys, "run", "--eager", "def f(x):", "--max-new-tokens", "2", "--trace", path)
    assert code == 0, err
    model = read_trace_model(pq.read_schema(path).metadata)
    config = bundled_model_path() / "config.json"
    assert model.config_sha256 == hashlib.sha256(config.read_bytes()).hexdigest()
    assert model.experts == {0: 128, 1: 128, 2: 128, 3: 128} and set(model.top_k.values()) == {2}
    report = sim(capsys, path, "--slots", "25%")
    assert report["results"][0]["slots"] == 32  # what `moekit run --expert-memory 25%` keeps


def test_unreadable_metadata_is_one_line(capsys, tmp_path):
    path = tmp_path / "bad.parquet"
    table = pa.table({"step": pa.array([0], pa.int32()), "row": pa.array([0], pa.int32()),
                      "layer": pa.array([0], pa.int32()), "expert_ids": pa.array([[1, 2]], pa.list_(pa.int32()))})
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: b"{not json"}), path)
    assert "unreadable moekit metadata" in fails(capsys, path, "--slots", "2")


@pytest.mark.parametrize("doc", [{"format": "other"}, {"format": "moekit-trace"}])
def test_foreign_or_partial_metadata_is_refused(doc):
    from moekit.errors import MoekitError

    with pytest.raises(MoekitError, match="unreadable moekit metadata"):
        read_trace_model({METADATA_KEY: json.dumps(doc).encode()})
