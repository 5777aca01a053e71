"""Routing policies as a user meets them: `moekit run --routing`, `moekit eval-routing` on the
bundled model (policies that keep every expert cost exactly nothing), and bad policies refused."""

from __future__ import annotations

import json

import pytest
from cli_runner import moekit


def fails(capsys, *args) -> str:
    code, out, err = moekit(capsys, *args)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_run_with_a_policy_that_keeps_every_expert_is_exact(capsys):
    args = ("run", "--eager", "def parse_args(argv):", "--max-new-tokens", "12", "--json")
    _, exact, _ = moekit(capsys, *args)
    for policy in ("topk:2", "adaptive:1.5", "topp:1", "ema:0"):
        code, out, err = moekit(capsys, *args, "--routing", policy)
        assert code == 0, err
        assert json.loads(out)["token_ids"] == json.loads(exact)["token_ids"], policy


def test_run_with_top1_touches_fewer_parameters(capsys):
    code, out, err = moekit(capsys, "run", "--eager", "def parse_args(argv):", "--max-new-tokens", "6", "--json", "--routing", "topk:1")
    assert code == 0, err
    acts = json.loads(out)["activation"]
    assert all(len(set(ids)) == 1 for a in acts for ids in a["experts"].values())
    assert all(a["share"] < 0.0935 for a in acts)


def test_eval_routing_on_the_bundled_model(capsys, tmp_path):
    plot = tmp_path / "pareto.png"
    code, out, err = moekit(capsys, "eval-routing", "--policies", "top2,topk:1,adaptive:1.5,adaptive:0.85",
                            "--max-tokens", "300", "--agree-prompts", "1", "--agree-tokens", "8", "--json",
                            "--plot", plot)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["policies"] == ["exact", "topk:2", "topk:1", "adaptive:1.5", "adaptive:0.85"]
    every = doc["all"]
    for same in ("exact", "topk:2", "adaptive:1.5"):
        assert every[same]["delta_bits_per_byte"] == 0.0
        assert every[same]["next_token_agreement"] == 1.0 and every[same]["generated_agreement"] == 1.0
        assert every[same]["experts_per_token"] == 2.0
    assert every["exact"]["active_share"] == pytest.approx(0.0935, abs=5e-5)
    assert every["topk:1"]["experts_per_token"] == 1.0
    assert every["topk:1"]["active_share"] < every["adaptive:0.85"]["active_share"] <= every["exact"]["active_share"]
    assert every["topk:1"]["delta_bits_per_byte"] > 0
    assert set(doc["domains"]) == {"manpages", "python", "shell", "fortunes", "chinese"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("policy,says", [("adaptive:2x", "not a number"), ("topk:0", "1..128"), ("topk:129", "1..128"),
                                         ("fastest", "unknown routing policy")])
def test_bad_policies(capsys, policy, says):
    assert says in fails(capsys, "run", "--eager", "hello", "--max-new-tokens", "2", "--routing", policy)
    assert says in fails(capsys, "eval-routing", "--policies", policy, "--max-tokens", "10")


def test_empty_prompts_file(capsys, tmp_path):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("\n")
    assert "no prompts" in fails(capsys, "report", "--prompts", empty, "--out", tmp_path / "r.html")
    empty.write_text("not json\n")
    assert "not a prompt line" in fails(capsys, "report", "--prompts", empty, "--out", tmp_path / "r.html")


def test_run_with_gumbel_noise_takes_the_runs_seed(capsys):
    args = ("run", "--eager", "def parse_args(argv):", "--max-new-tokens", "12", "--json", "--routing", "gumbel:2")
    runs = [json.loads(moekit(capsys, *args, "--seed", seed)[1])["token_ids"] for seed in ("3", "3", "4")]
    _, exact, _ = moekit(capsys, "run", "--eager", "def parse_args(argv):", "--max-new-tokens", "12", "--json")
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert runs[0] != json.loads(exact)["token_ids"]
