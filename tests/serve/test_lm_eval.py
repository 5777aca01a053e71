"""lm-evaluation-harness against `moekit serve`, as the README tells a user to run it: its
`local-completions` model on the two local tasks in benchmarks/lm_eval (multiple choice, scored by
loglikelihood through echo + logprobs; and generate_until), no hub (HF_DATASETS_OFFLINE=1), the
tokenizer the server's own (lm-eval's `auto` backend finds /tokenize and /tokenizer_info).

What lm-eval reports is checked against moekit in this process: each choice's loglikelihood
against log_softmax of moekit's forward, each generation against greedy `generate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[2]


def lm_eval_command(base_url: str, output: Path) -> list[str]:
    """The README's command (section "lm-evaluation-harness")."""
    return [
        str(Path(sys.executable).with_name("lm_eval")), "--model", "local-completions",
        "--model_args", f"model=moekit-demo,base_url={base_url}/completions,num_concurrent=2,max_retries=1",
        "--tasks", "moekit_mc,moekit_gen", "--include_path", "benchmarks/lm_eval",
        "--output_path", str(output), "--log_samples",
    ]


def continuation_logprob(engine, context: str, continuation: str) -> float:
    """Sum of log p(continuation token | everything before) from moekit's forward, split as lm-eval splits."""
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    spaces = len(context) - len(context.rstrip())  # lm-eval moves a context's trailing spaces to the continuation
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    with torch.inference_mode():
        cache = engine.decoder.new_cache(1, len(whole))
        logits = engine.decoder(torch.tensor([whole]), cache, torch.arange(len(whole))[None])
    logprobs = torch.log_softmax(logits[0].float(), dim=-1)
    return sum(float(logprobs[t - 1, whole[t]]) for t in range(len(ctx), len(whole)))


def greedy_text(engine, context: str, new: int) -> str:
    ids = engine.tokenizer.encode(context, add_special_tokens=False).ids
    text = engine.decode(engine.generate([ids], max_new_tokens=new).token_ids[0])
    return text.split("\n", 1)[0]


def test_lm_eval_local_completions_scores_and_generates_through_moekit_serve(server, engine, tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(lm_eval_command(server.v1, tmp_path / "out"), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "remote tokenizer" in done.stderr.lower()  # lm-eval used the server's /tokenize
    [results] = (tmp_path / "out").rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]
    assert 0.0 <= scores["moekit_mc"]["acc,none"] <= 1.0 and "exact_match,none" in scores["moekit_gen"]

    [mc] = (tmp_path / "out").rglob("samples_moekit_mc_*.jsonl")
    for line in mc.read_text().splitlines():
        sample = json.loads(line)
        context = sample["doc"]["context"]
        for choice, [[loglikelihood, _]] in zip(sample["doc"]["choices"], sample["resps"]):
            assert float(loglikelihood) == pytest.approx(continuation_logprob(engine, context, choice), abs=2e-3)
    [gen] = (tmp_path / "out").rglob("samples_moekit_gen_*.jsonl")
    for line in gen.read_text().splitlines():
        sample = json.loads(line)
        assert sample["resps"] == [[greedy_text(engine, sample["doc"]["context"], 12)]]
