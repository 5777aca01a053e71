"""`moekit bench offload --vs accelerate` end to end on a tiny checkpoint, as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import moekit
from hf_tiny import train_tokenizer, write_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    folder = write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("bench_offload"), vocab_size=300)
    train_tokenizer(folder / "tokenizer.json", vocab_size=300)
    return folder


# Each budget costs a moekit run and an accelerate child (which imports transformers): the default
# run takes the paged budget only. The resident row's empty disk and stall columns are checked by
# tests/commands/test_cli_offload.py, accelerate with everything in memory by test_accelerate_baseline.py.
@pytest.mark.parametrize("budgets", ["25%", pytest.param("25%,100%", marks=pytest.mark.slow)])
def test_bench_offload_vs_accelerate_reports_disk_bytes_and_stall_per_token(capsys, ckpt, tmp_path, budgets):
    raw = tmp_path / "bench.json"
    code, out, err = moekit(capsys, "bench", "offload", ckpt, "--expert-memory", budgets, "--tokens", "6",
                            "--dtype", "float32", "--vs", "accelerate", "--json", "--json-out", raw)
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["budget"] for r in rows] == budgets.split(",")
    paged = rows[0]
    # A quarter of the experts: some decode tokens miss, read bytes from disk and wait for them.
    assert paged["disk_bytes_per_token"] > 0
    assert paged["stall_s_per_token"] > 0 and 0 < paged["stall_share"] <= 1
    for resident in rows[1:]:
        assert resident["disk_bytes_per_token"] is None and resident["stall_s_per_token"] is None
    for row in rows:
        assert row["same_tokens"] and row["accelerate_same_tokens"]
        assert row["accelerate_tokens_per_s"] > 0
        assert row["vs_accelerate"] == pytest.approx(row["tokens_per_s"] / row["accelerate_tokens_per_s"])
    results = json.loads(raw.read_text())["results"]
    # The same memory for accelerate: moekit's dense weights + the budget, the rest of its model on disk.
    assert results["accelerate@25%"]["memory_bytes"] == results["moekit@25%"]["dense_bytes"] + results["moekit@25%"]["budget_bytes"]
    assert results["accelerate@25%"]["offloaded_bytes"] > 0


def test_bench_offload_refuses_an_unknown_baseline(capsys, ckpt):
    code, _, err = moekit(capsys, "bench", "offload", ckpt, "--vs", "llama.cpp")
    assert code == 2 and "accelerate" in err
