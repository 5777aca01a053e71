"""`moekit run --expert-parallel`, `moekit placement` and `moekit simulate` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import moekit

# Rank processes (torchrun, --expert-parallel); tests/conftest.py keeps such tests from overlapping.
pytestmark = pytest.mark.processes

MOEKIT = Path(sys.executable).parent / "moekit"
IDS = "1,17,42,9,33"


def fails(capsys, *args) -> str:
    code, out, err = moekit(capsys, *args)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def qwen_trace(tiny_checkpoints, tmp_path_factory) -> Path:
    ckpt = tiny_checkpoints("qwen3_moe")
    trace = tmp_path_factory.mktemp("trace") / "t.parquet"
    proc = subprocess.run([MOEKIT, "run", "--eager", ckpt, "--prompt-ids", IDS, "--max-new-tokens", "12", "--trace", trace],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return trace


def _run(*args) -> tuple[list[int], str]:
    """`moekit run ARGS --json`: (its token ids, its stderr)."""
    proc = subprocess.run([MOEKIT, "run", *map(str, args), "--json"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["token_ids"], proc.stderr


def _tokens(*args) -> list[int]:
    return _run("--eager", *args)[0]


def test_expert_parallel_2_generates_the_single_process_tokens(tiny_checkpoints, qwen_trace, tmp_path, capsys):
    ckpt = tiny_checkpoints("qwen3_moe")
    alone = _tokens(ckpt, "--prompt-ids", IDS, "--max-new-tokens", 12)
    # Without --eager: the default's compiled step does not cover `run --expert-parallel`, so the run
    # falls back to eager with one note (an explicit --compile is refused: tests/model/test_combinations).
    sharded, err = _run(ckpt, "--prompt-ids", IDS, "--max-new-tokens", 12, "--expert-parallel", 2)
    assert sharded == alone
    said = [line for line in err.splitlines() if "compile" in line]
    assert len(said) == 1 and said[0].startswith("note: decode steps run eager:"), err
    plan = tmp_path / "p.json"
    code, out, err = moekit(capsys, "placement", qwen_trace, "--ranks", 2, "--out", plan)
    assert code == 0, err
    assert json.loads(plan.read_text())["redundant"] == 2  # 8 experts split evenly: one spare per rank
    assert _tokens(ckpt, "--prompt-ids", IDS, "--max-new-tokens", 12, "--expert-parallel", 2, "--placement", plan) == alone


def test_each_rank_pages_its_experts_with_an_expert_store(tiny_checkpoints, tmp_path):
    import shutil

    ckpt = shutil.copytree(tiny_checkpoints("qwen3_moe"), tmp_path / "ckpt")  # the manifest is written beside it
    alone = _tokens(ckpt, "--prompt-ids", IDS, "--max-new-tokens", 12)
    assert _tokens(ckpt, "--prompt-ids", IDS, "--max-new-tokens", 12, "--expert-memory", "50%",
                   "--expert-parallel", 2) == alone


def test_torchrun_ranks_generate_the_single_process_tokens(tiny_checkpoints):
    ckpt = tiny_checkpoints("qwen3_moe")
    alone = _tokens(ckpt, "--prompt-ids", IDS, "--max-new-tokens", 12)
    torchrun = Path(sys.executable).parent / "torchrun"
    # --standalone: torchrun's own rendezvous on a free loopback port.
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "moekit", "run", "--eager", ckpt, "--prompt-ids",
                           IDS, "--max-new-tokens", "12", "--json", "--expert-parallel", "auto", "--ep-timeout", "60"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1  # rank 0 prints, rank 1 is quiet
    assert json.loads(lines[0])["token_ids"] == alone


def test_bad_expert_parallel_requests_are_one_line(tiny_checkpoints, qwen_trace, tmp_path, capsys):
    mixtral, qwen = tiny_checkpoints("mixtral"), tiny_checkpoints("qwen3_moe")
    run = ("run", "--eager", "--prompt-ids", IDS)
    assert "8 ranks but only 6 routed experts" in fails(capsys, run[0], mixtral, *run[1:], "--expert-parallel", 8)
    assert "rank count or auto" in fails(capsys, run[0], mixtral, *run[1:], "--expert-parallel", "two")
    assert "needs torchrun" in fails(capsys, run[0], mixtral, *run[1:], "--expert-parallel", "auto")
    plan = tmp_path / "p.json"
    assert moekit(capsys, "placement", qwen_trace, "--ranks", 2, "--out", plan)[0] == 0
    assert "--placement needs --expert-parallel" in fails(capsys, run[0], qwen, *run[1:], "--placement", plan)
    assert "made for" in fails(capsys, run[0], mixtral, *run[1:], "--expert-parallel", 2, "--placement", plan)
    assert "is for 2 ranks, this run has 4" in fails(capsys, run[0], qwen, *run[1:], "--expert-parallel", 4,
                                                     "--placement", plan)
    doc = json.loads(plan.read_text())
    doc["layers"]["0"]["ranks"] = [[0, 1], [2, 3]]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(doc))
    assert "places no copy of expert 4" in fails(capsys, run[0], qwen, *run[1:], "--expert-parallel", 2,
                                                 "--placement", broken)


def test_placement_reports_linear_against_the_plan(qwen_trace, tmp_path, capsys):
    code, out, err = moekit(capsys, "placement", qwen_trace, "--ranks", 4, "--redundant", 4, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["ranks"] == 4 and doc["redundant"] == 4
    for ids in doc["layers"]["0"]["ranks"]:
        assert len(ids) == 3  # (8 + 4) / 4 physical experts on every rank
    assert doc["balancedness"]["plan"] >= doc["balancedness"]["linear"]
    assert "do not divide over 3 ranks" in fails(capsys, "placement", qwen_trace, "--ranks", 3, "--redundant", 2)


def test_simulate_answers_for_many_ranks(tiny_checkpoints, qwen_trace, capsys):
    ckpt = tiny_checkpoints("qwen3_moe")
    code, out, err = moekit(capsys, "simulate", qwen_trace, "--model", ckpt, "--ranks", "2,8", "--hardware", "h100",
                            "--json")
    assert code == 0, err
    results = json.loads(out)["results"]
    assert [(r["ranks"], r["placement"]) for r in results] == [(2, "linear"), (2, "eplb"), (8, "linear"), (8, "eplb")]
    assert all(r["moe_time_per_forward_s"] > 0 for r in results)
    assert results[2]["inter_node_bytes_per_token"] == 0  # 8 ranks are one node
    code, out, err = moekit(capsys, "simulate", "--uniform", "deepseek-v3", "--tokens", 64, "--forwards", 1,
                            "--ranks", "16", "--json")
    assert code == 0, err
    assert json.loads(out)["results"][0]["inter_node_bytes_per_token"] > 0
    assert "no link bandwidths known for 'h100-pcie'" in fails(capsys, "simulate", qwen_trace, "--model", ckpt,
                                                               "--hardware", "h100-pcie")



def test_a_trace_moekit_wrote_is_enough_for_simulate(tiny_checkpoints, qwen_trace, tmp_path, capsys):
    """`run --trace` records the shapes simulate prices: the same answer as naming the model."""
    args = ("--ranks", "2,4", "--hardware", "h100", "--json")
    code, alone, err = moekit(capsys, "simulate", qwen_trace, *args)
    assert code == 0, err
    code, named, err = moekit(capsys, "simulate", qwen_trace, "--model", tiny_checkpoints("qwen3_moe"), *args)
    assert code == 0, err
    assert json.loads(alone)["results"] == json.loads(named)["results"]
    assert json.loads(alone)["model"] == json.loads(named)["model"]


def test_a_trace_without_the_shapes_needs_a_model(qwen_trace, tmp_path, capsys):
    """A trace written before the shapes were recorded (or by another tool) names no hidden size."""
    import pyarrow.parquet as pq

    table = pq.read_table(qwen_trace)
    doc = json.loads(table.schema.metadata[b"moekit"])
    for key in ("hidden_size", "expert", "router_groups"):
        doc.pop(key)
    old = tmp_path / "old.parquet"
    pq.write_table(table.replace_schema_metadata({b"moekit": json.dumps(doc).encode()}), old)
    assert "records no hidden size" in fails(capsys, "simulate", old)
