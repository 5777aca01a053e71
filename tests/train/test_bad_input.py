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


def _reference_perplexities(model_dir, corpus, max_tokens, window=256):
    """domain -> (perplexity from transformers' own loss, add-one unigram perplexity) on the tokens
    `moekit eval` scores: each domain's held-out stream (documents + eos) cut into windows of 256 from
    its start, each window's first token unscored; the unigram counts the train split."""
    import math

    import torch
    import transformers
    from tokenizers import Tokenizer

    from moekit.corpus.reader import read_split

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.config.eos_token_id

    def stream(docs):
        return [t for enc in tok.encode_batch(docs) for t in (*enc.ids, eos)]

    counts = torch.ones(model.config.vocab_size, dtype=torch.float64)
    for docs in read_split(corpus, "train").values():
        counts += torch.bincount(torch.tensor(stream(docs)), minlength=len(counts)).double()
    log_p = (counts / counts.sum()).log()
    out = {}
    for domain, docs in read_split(corpus, "heldout").items():
        ids = stream(docs)[:max_tokens]
        model_nll = unigram_nll = scored = 0.0
        for begin in range(0, len(ids), window):
            w = torch.tensor(ids[begin : begin + window])
            with torch.inference_mode():
                model_nll += float(model(input_ids=w[None], labels=w[None]).loss) * (len(w) - 1)
            unigram_nll -= float(log_p[w[1:]].sum())
            scored += len(w) - 1
        out[domain] = (math.exp(model_nll / scored), math.exp(unigram_nll / scored), int(scored))
    return out


def test_eval_reports_perplexity_per_domain_against_unigram(moekit, tiny_run, tiny_corpus):
    import json

    done = moekit("eval", str(tiny_run[0]), "--corpus", str(tiny_corpus), "--json", "--max-tokens", "600")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["domains"]) == {"python", "prose"}
    reference = _reference_perplexities(tiny_run[0] / "model", tiny_corpus, max_tokens=600)
    for name, d in result["domains"].items():
        model_ppl, unigram_ppl, scored = reference[name]
        assert d["tokens"] == scored == 597  # 600 tokens in windows of 256: 3 first tokens unscored
        assert d["perplexity"] == pytest.approx(model_ppl, rel=1e-4)
        assert d["unigram_perplexity"] == pytest.approx(unigram_ppl, rel=1e-9)
        assert all(abs(sum(layer) - 1) < 1e-6 for layer in d["expert_usage"])
    js = result["js_divergence"]
    assert js["python"]["python"] == 0 and 0 < js["python"]["prose"] == js["prose"]["python"] <= 1
