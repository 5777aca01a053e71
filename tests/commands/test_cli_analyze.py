"""`moekit analyze` as a user runs it: tables and --json of a hand-built trace and of a real trace of
the bundled model, and one clear line for a trace it cannot read."""

from __future__ import annotations

import json

import pytest

from cli_runner import moekit
from routing_traces import model, sequence, write


def fails(capsys, *args) -> str:
    code, out, err = moekit(capsys, *args)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_tables_and_json_of_a_collapsed_trace(capsys, tmp_path):
    trace = write(tmp_path / "t.parquet", sequence([(0,)] * 32), model(8, 1))  # 4 tokens per expert: a verdict
    code, out, _ = moekit(capsys, "analyze", trace)
    assert code == 0 and "collapsed" in out and "hit rate" in out
    code, out, _ = moekit(capsys, "analyze", trace, "--json")
    doc = json.loads(out)
    assert doc["layers"]["0"]["verdict"] == "collapsed" and doc["layers"]["0"]["unused"] == 7
    assert doc["activation"]["share_of"] == "routed experts only"


def test_a_real_trace_of_the_bundled_model(capsys, tmp_path):
    trace = tmp_path / "run.parquet"
    code, _, err = moekit(capsys, "run", "--eager", "def parse_args(argv):", "--max-new-tokens", "8", "--trace", trace)
    assert code == 0, err
    code, out, _ = moekit(capsys, "analyze", trace, "--json")
    doc = json.loads(out)
    # the trace's config fingerprint is the bundled model's: its parameter counts are used
    assert doc["activation"]["share_of"].startswith("all parameters")
    assert doc["activation"]["share"]["min"] == pytest.approx(0.0935, abs=5e-5)
    assert doc["activation"]["share"]["max"] == doc["activation"]["share"]["min"]  # K = 2 in every layer, always
    assert doc["activation"]["experts_per_token"]["mean"] == 8.0  # 2 experts × 4 MoE layers
    assert set(doc["layers"]) == {"0", "1", "2", "3"}


def test_bad_traces_are_one_line(capsys, tmp_path):
    (tmp_path / "x.parquet").write_text("hello")
    assert "not a Parquet trace" in fails(capsys, "analyze", tmp_path / "x.parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"layer": [0]}), tmp_path / "cols.parquet")
    assert "missing column" in fails(capsys, "analyze", tmp_path / "cols.parquet")
    write(tmp_path / "other.parquet", sequence([(0, 40)]), model(8, 2))
    assert "another model" in fails(capsys, "analyze", tmp_path / "other.parquet")
    assert "no such trace" in fails(capsys, "analyze", tmp_path / "none.parquet")
    assert "--num-experts" in fails(capsys, "analyze", tmp_path / "other.parquet", "--num-experts", "0")
