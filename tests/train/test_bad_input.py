"""What a user gets wrong: one line on stderr, exit 2, no traceback."""

import sys
from dataclasses import dataclass

import pytest

from moekit.cli import main
from train_fixtures import TINY_MODEL, tiny_config


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def moekit(capsys, monkeypatch):
    """The real entry point in-process (argv, exit code, stdout, stderr), without a fresh interpreter each time."""

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["moekit", *args])
        code = 0
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        out, err = capsys.readouterr()
        return Done(code, out, err)

    return run


def _one_line_error(done, *needles):
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "change, needle",
    [
        (("num_experts_per_tok = 2", "num_experts_per_tok = 9"), "K=9"),
        (("num_key_value_heads = 2", "num_key_value_heads = 3"), "multiple of num_key_value_heads"),
        (("head_dim = 8", "head_dim = 7"), "must be even"),
        (("model_type = \"qwen3_moe\"", "model_type = \"llama\""), "model_type must be one of"),
        (("hidden_size = 32", "hidden_size = 32\nbogus = 1\n[extra]"), "unknown table [extra]"),
    ],
)
def test_bad_model_configs(moekit, tmp_path, change, needle):
    config = tiny_config(tmp_path, tmp_path / "corpus", model=TINY_MODEL.replace(*change))
    _one_line_error(moekit("train", "--config", str(config), "--out", str(tmp_path / "run")), needle)


def test_missing_corpus(moekit, tmp_path):
    config = tiny_config(tmp_path, tmp_path / "no_corpus")
    _one_line_error(moekit("train", "--config", str(config), "--out", str(tmp_path / "run")), "no such corpus folder")


def test_empty_domain(moekit, tiny_corpus, tmp_path):
    import shutil

    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus, corpus)
    (corpus / "train" / "prose.jsonl").write_text("")
    config = tiny_config(tmp_path, corpus)
    _one_line_error(moekit("train", "--config", str(config), "--out", str(tmp_path / "run")), "'prose' has no train documents")


def test_run_folder_with_another_run_and_eval_of_nothing(moekit, tiny_run, tmp_path):
    run, config, _ = tiny_run
    _one_line_error(moekit("train", "--config", str(config), "--out", str(run)), "--resume", "--force")
    _one_line_error(moekit("eval", str(tmp_path)), "neither a checkpoint")


def test_eval_reports_perplexity_per_domain_against_unigram(moekit, tiny_run, tiny_corpus):
    import json

    done = moekit("eval", str(tiny_run[0]), "--corpus", str(tiny_corpus), "--json", "--max-tokens", "600")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["domains"]) == {"python", "prose"}
    for d in result["domains"].values():
        assert d["tokens"] > 100 and d["perplexity"] > 1 and d["unigram_perplexity"] > 1
        assert all(abs(sum(layer) - 1) < 1e-6 for layer in d["expert_usage"])
    js = result["js_divergence"]
    assert js["python"]["python"] == 0 and 0 < js["python"]["prose"] == js["prose"]["python"] <= 1
