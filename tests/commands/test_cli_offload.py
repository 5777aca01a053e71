"""`moekit run --expert-memory`, `moekit profile` and `moekit bench offload` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_tiny import train_tokenizer, write_checkpoint
from cli_runner import moekit


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    folder = write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("offload_cli"), vocab_size=300)
    train_tokenizer(folder / "tokenizer.json", vocab_size=300)
    return folder


def test_run_with_an_expert_budget_reports_the_store_and_matches_resident(capsys, ckpt):
    code, out, _ = moekit(capsys, "run", "--eager", ckpt, "def f(x):", "--max-new-tokens", "12", "--json", "--stop", "")
    assert code == 0
    resident = json.loads(out)
    code, out, err = moekit(capsys, "run", "--eager", ckpt, "def f(x):", "--max-new-tokens", "12", "--json", "--stop", "",
                            "--expert-memory", "25%", "--cache", "lfu")
    assert code == 0, err
    paged = json.loads(out)
    assert paged["token_ids"] == resident["token_ids"]
    report = paged["offload"]
    assert report["policy"] == "lfu" and report["slots_per_layer"] == 2
    assert 0 <= report["decode"]["hit_rate"] <= 1 and report["peak_rss_bytes"] > 0
    assert report["peak_resident_expert_bytes"] <= report["budget_bytes"]
    assert set(report["decode"]["hit_rate_per_layer"]) == {"0", "1"}


def test_show_activation_prints_the_store_table(capsys, ckpt):
    code, out, _ = moekit(capsys, "run", "--eager", ckpt, "x = 1", "--max-new-tokens", "4", "--expert-memory", "50%",
                          "--show-activation")
    assert code == 0 and "expert store" in out and "prefetch precision / recall" in out


def test_profile_writes_pins_that_run_accepts(capsys, ckpt, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\nimport os\\nimport sys\n")
    profile = tmp_path / "profile.json"
    code, out, err = moekit(capsys, "profile", ckpt, "--prompts", prompts, "--out", profile, "--max-new-tokens", "6",
                            "--top", "1")
    assert code == 0, err
    doc = json.loads(profile.read_text())
    assert doc["workload"]["prompts"] == 2 and set(doc["pins"]) == {"0", "1"}
    assert all(len(v) == 1 for v in doc["pins"].values())
    counts = doc["counts"]["0"]
    assert doc["pins"]["0"][0] == max(range(len(counts)), key=lambda e: (counts[e], -e))
    code, out, err = moekit(capsys, "run", "--eager", ckpt, "def f(x):", "--max-new-tokens", "4", "--json",
                            "--expert-memory", "50%", "--pin", profile)
    assert code == 0, err
    assert json.loads(out)["offload"]["pinned"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--expert-memory", "lots"], "--expert-memory"),
        (["--expert-memory", "1KiB"], "below the minimum"),
        (["--expert-memory", "25%", "--cache", "fifo"], "unknown cache policy"),
        (["--cache", "lfu"], "need --expert-memory"),
        (["--expert-memory", "25%", "--pin", "/nonexistent/profile.json"], "no such pin file"),
        (["--expert-memory", "25%", "--read-ahead", "-1"], "--read-ahead must be 0 or more"),
        (["--expert-memory", "25%", "--expert-split", "/nonexistent/t.parquet"], "no such trace file"),
        (["--expert-split", "/nonexistent/t.parquet"], "need --expert-memory"),
        (["--direct-io"], "need --expert-memory"),
    ],
)
def test_bad_offload_options_are_one_line_errors(capsys, ckpt, args, message):
    code, _, err = moekit(capsys, "run", "--eager", ckpt, "x", "--max-new-tokens", "2", *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_a_missing_packed_file_is_named(capsys, ckpt, tmp_path):
    folder = tmp_path / "packed"
    code, _, err = moekit(capsys, "pack", ckpt, "--out", folder)
    assert code == 0, err
    code, out, _ = moekit(capsys, "run", "--eager", folder, "def f(x):", "--max-new-tokens", "6", "--json", "--expert-memory", "25%")
    assert code == 0
    (folder / "experts.packed.safetensors").unlink()
    code, _, err = moekit(capsys, "run", "--eager", folder, "def f(x):", "--max-new-tokens", "6", "--expert-memory", "25%")
    assert code == 2 and "experts.packed.safetensors" in err and "moekit pack" in err


def test_bench_offload_runs_every_configuration_and_agrees_with_resident(capsys, ckpt, tmp_path):
    raw = tmp_path / "bench.json"
    code, out, err = moekit(capsys, "bench", "offload", ckpt, "--expert-memory", "25%,100%", "--tokens", "6",
                            "--json", "--json-out", raw)
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["budget"] for r in rows] == ["25%", "100%"]
    assert all(r["same_tokens"] for r in rows)
    assert rows[0]["hit_rate"] is not None and rows[1]["hit_rate"] is None  # 100% runs resident
    assert rows[0]["disk_bytes_per_token"] > 0  # a quarter of the experts: misses read from disk
    assert rows[1]["disk_bytes_per_token"] is None and rows[1]["stall_s_per_token"] is None
    assert json.loads(raw.read_text())["results"]["no-cache"]["offload"]["decode"]["hit_rate"] == 0.0
