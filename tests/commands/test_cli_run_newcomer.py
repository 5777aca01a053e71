"""`moekit run`'s quiet mistakes made loud (issue 15): a checkpoint that is not there, sampling
options at greedy, a trace named for another format, and the figures a text-mode run prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import moekit, refused
from hf_tiny import train_tokenizer, write_checkpoint

BUNDLED_NOTE = "is no checkpoint folder, so it is the prompt for the bundled model"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    folder = write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("run_newcomer"), vocab_size=300)
    train_tokenizer(folder / "tokenizer.json", vocab_size=300)
    return folder


def test_a_checkpoint_that_is_not_there_is_named(capsys):
    assert "mymodel: no such checkpoint folder" in refused(capsys, "run", "mymodel", "hello")


@pytest.mark.parametrize("kind", ["separator", "file"])
def test_a_lone_path_like_argument_is_said_to_be_the_bundled_models_prompt(capsys, tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    if kind == "file":
        (tmp_path / "notes.txt").write_text("hello")
    arg = "notes.txt" if kind == "file" else "./mymodel"
    code, out, err = moekit(capsys, "run", "--eager", arg, "--max-new-tokens", "1", "--json")
    assert code == 0 and BUNDLED_NOTE in err and repr(arg) in err
    assert len(json.loads(out)["token_ids"]) == 1


def test_a_plain_prompt_gets_no_note(capsys):
    code, _, err = moekit(capsys, "run", "--eager", "def f(x):", "--max-new-tokens", "1", "--json")
    assert code == 0 and BUNDLED_NOTE not in err


@pytest.mark.parametrize("option", [("--top-k", "5"), ("--top-p", "0.9")])
def test_a_sampling_option_samples_at_temperature_one(capsys, ckpt, option):
    from moekit.engine.loader import load_engine
    from moekit.engine.sampling import SamplingParams

    base = ("run", "--eager", ckpt, "--prompt-ids", "1,17,42", "--max-new-tokens", "16", "--stop", "", "--json")
    code, out, _ = moekit(capsys, *base, *option, "--seed", "3")
    assert code == 0
    name = option[0][2:].replace("-", "_")
    want = SamplingParams(temperature=1.0, seed=3, **{name: type(1 if name == "top_k" else 0.5)(option[1])})
    expected = load_engine(ckpt, compile=False).generate([1, 17, 42], max_new_tokens=16, sampling=want, stop_ids=()).token_ids[0]
    greedy = json.loads(moekit(capsys, *base)[1])["token_ids"]
    assert json.loads(out)["token_ids"] == expected != greedy


def test_a_sampling_option_at_an_explicit_greedy_temperature_is_refused(capsys, ckpt):
    err = refused(capsys, "run", ckpt, "--prompt-ids", "1", "--top-p", "0.9", "--temperature", "0")
    assert "--top-p samples" in err and "--temperature 0 is greedy" in err


def test_a_trace_named_for_another_format_is_refused_before_running(capsys, ckpt, tmp_path):
    err = refused(capsys, "run", ckpt, "--prompt-ids", "1", "--trace", tmp_path / "t.csv")
    assert "written as Parquet" in err and "t.parquet" in err
    assert not (tmp_path / "t.csv").exists()


def test_text_mode_with_an_expert_budget_prints_one_paging_line(capsys, ckpt):
    code, out, err = moekit(capsys, "run", "--eager", ckpt, "def f(x):", "--max-new-tokens", "8", "--stop", "",
                            "--expert-memory", "50%")
    assert code == 0
    code, js, _ = moekit(capsys, "run", "--eager", ckpt, "def f(x):", "--max-new-tokens", "8", "--stop", "",
                         "--expert-memory", "50%", "--json")
    decode = json.loads(js)["offload"]["decode"]
    lines = [line for line in err.splitlines() if line.startswith("[expert store")]
    assert len(lines) == 1 and f"decode hit rate {decode['hit_rate']:.1%}" in lines[0]
    assert "disk " in lines[0] and "per token" in lines[0] and "stall " in lines[0]
    assert "expert store" not in out  # the text stays text


def test_text_mode_states_the_prompt_and_the_sampling(capsys, ckpt):
    code, _, err = moekit(capsys, "run", "--eager", ckpt, "def f(x):", "--max-new-tokens", "2", "--temperature", "0.7",
                          "--top-p", "0.9", "--seed", "0")
    assert code == 0
    assert "sampling at temperature 0.7, top-p 0.9, seed 0 · prompt 'def f(x):'" in err
    code, _, err = moekit(capsys, "run", "--eager", ckpt, "def f(x):", "--max-new-tokens", "2")
    assert "greedy · prompt 'def f(x):'" in err


def test_activation_table_says_a_constant_parameter_count_once_and_explains_distinct_experts(capsys, ckpt):
    code, out, _ = moekit(capsys, "run", "--eager", ckpt, "--prompt-ids", "1,17,42", "--max-new-tokens", "5", "--stop", "",
                          "--show-activation")
    assert code == 0
    flat = " ".join(out.split())
    assert flat.count("every token touches") == 1 and "params touched" not in flat
    assert "distinct experts: running total" in flat and "2 MoE layers × 8 experts = 16" in flat
