"""The decode benchmark: both sides generate the same tokens, and its bytes come from the meter."""

from __future__ import annotations

import pytest

from moekit.engine.bench_decode import BenchSettings, bench_decode
from moekit.engine.loader import load_engine
from moekit.engine.meter import decode_step_params

transformers = pytest.importorskip("transformers")


def test_batch_one_step_bytes_are_the_meters_bytes_per_token(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("deepseek_v3"))
    gen = engine.generate([1, 17, 42, 99], max_new_tokens=8, stop_ids=())
    per_token = [a.params_touched for a in engine.meter(gen)[1:]]  # tokens made by decode steps
    assert decode_step_params(engine.spec, gen) == per_token


def test_a_batch_reads_each_chosen_expert_once(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"))
    gen = engine.generate([[1, 17, 42], [5, 6, 7], [9, 10, 11]], max_new_tokens=4, stop_ids=())
    acts = engine.meter(gen)
    steps = decode_step_params(engine.spec, gen)
    one_token = acts[0].params_touched
    for step, total in enumerate(steps, start=1):
        row_tokens = [a for a in acts if a.index == step]
        # Three rows never read less than one row, nor more than three rows' worth.
        assert one_token <= total <= sum(a.params_touched for a in row_tokens)


def test_bench_compares_with_transformers_on_identical_tokens(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"))
    settings = BenchSettings(batches=(1, 3), tokens=6, prompt_len=5, repeats=1, warmup=0)
    results = bench_decode(engine, settings, vs_transformers=True, bandwidth_bytes_s=20e9)
    assert [r.batch for r in results] == [1, 3]
    for r in results:
        assert r.same_tokens is True
        assert r.moekit_tok_s > 0 and r.transformers_tok_s > 0
        assert r.ratio == pytest.approx(r.moekit_tok_s / r.transformers_tok_s)
        assert r.roofline_tok_s == pytest.approx(r.batch * 20e9 / r.bytes_per_step)
