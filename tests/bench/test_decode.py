"""The decode benchmark: both sides generate the same tokens, and its bytes come from the meter
(each routed expert at the bytes it holds: int8 / packed experts are not counted at the dtype's)."""

from __future__ import annotations

import statistics

import pytest
import torch

from moekit.bench.decode import BenchSettings, bench_decode, bench_prompts, decode_baseline
from moekit.engine.generate import Generation, LayerRouting, StepRouting, Timing
from moekit.engine.loader import load_engine
from moekit.engine.meter import decode_step_bytes, decode_step_params, params_per_token
from moekit.spec import load_spec

transformers = pytest.importorskip("transformers")


def test_batch_one_step_bytes_are_the_meters_bytes_per_token(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("deepseek_v3"), compile=False)
    gen = engine.generate([1, 17, 42, 99], max_new_tokens=8, stop_ids=())
    per_token = [a.params_touched for a in engine.meter(gen)[1:]]  # tokens made by decode steps
    assert decode_step_params(engine.spec, gen) == per_token


def test_int8_experts_make_the_step_bytes_the_meters_int8_bytes(tiny_checkpoints):
    folder = tiny_checkpoints("qwen3_moe")
    int8, fp32 = load_engine(folder, weights="int8-experts", compile=False), load_engine(folder, compile=False)
    settings = BenchSettings(batches=(1,), tokens=6, prompt_len=5, repeats=1, warmup=0)
    (ours,), (plain,) = (bench_decode(e, settings, baseline=None, bandwidth_bytes_s=20e9) for e in (int8, fp32))
    prompt = bench_prompts(int8.spec.vocab_size, 1, settings.prompt_len, settings.seed + 1).tolist()
    gen = int8.generate(prompt, max_new_tokens=settings.tokens, stop_ids=())
    assert ours.bytes_per_step == pytest.approx(statistics.fmean(a.bytes_touched for a in int8.meter(gen)[1:]))
    # Batch 1 reads K distinct experts a layer every step: each one int8 instead of fp32.
    counts = params_per_token(int8.spec)
    layer = min(counts.top_k)
    saved = sum(counts.top_k.values()) * (counts.expert_each[layer] * 4 - int8.expert_bytes(layer, 0))
    assert plain.bytes_per_step - ours.bytes_per_step == pytest.approx(saved)
    assert ours.roofline_tok_s == pytest.approx(20e9 / ours.bytes_per_step) and ours.roofline_tok_s > plain.roofline_tok_s


def _routing(step: int, layers, rows: list[list[int]]) -> StepRouting:
    ids = torch.tensor(rows, dtype=torch.int64)  # [B, K]
    return StepRouting(step, 1, [LayerRouting(layer, ids, torch.full(ids.shape, 1 / ids.shape[1])) for layer in layers])


def test_a_batch_reads_each_chosen_expert_once(tiny_checkpoints):
    spec = load_spec(tiny_checkpoints("qwen3_moe"))
    layers = spec.moe_layers
    k = spec.layers[layers[0]].ffn.router.top_k
    first, shifted = list(range(k)), list(range(1, k + 1))
    # Step 1: three rows, two of them on the same K experts, the third shifted by one: K + 1 distinct.
    # Step 2: the third row has finished; the two left share all K.
    gen = Generation(
        prompts=[[1, 2], [3, 4], [5, 6]],
        token_ids=[[7, 8, 9], [7, 8, 9], [7, 8]],
        routing=[_routing(0, layers, [first] * 6), _routing(1, layers, [first, shifted, first]),
                 _routing(2, layers, [first, first, shifted])],
        timing=Timing(prefill_s=1.0, decode_s=1.0, prompt_tokens=6, decode_steps=2, batch=3),
        prompt_width=2,
    )
    c = params_per_token(spec)
    experts = sum(c.expert_each[layer] for layer in layers)  # one expert in every MoE layer
    shared = c.fixed + c.head
    assert decode_step_params(spec, gen) == [
        shared + (k + 1) * experts + 3 * c.embedding_row,
        shared + k * experts + 2 * c.embedding_row,
    ]
    # Each expert holding 1000 bytes: the batch's distinct experts at 1000 each, the rest at fp32.
    held = 1000 * len(layers)  # one expert in every MoE layer
    assert decode_step_bytes(spec, gen, 4, lambda layer, e: 1000) == [
        (shared + 3 * c.embedding_row) * 4 + (k + 1) * held,
        (shared + 2 * c.embedding_row) * 4 + k * held,
    ]


def test_bench_compares_with_transformers_on_identical_tokens(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    settings = BenchSettings(batches=(1, 3), tokens=6, prompt_len=5, repeats=1, warmup=0)
    results = bench_decode(engine, settings, baseline=decode_baseline("transformers", engine), bandwidth_bytes_s=20e9)
    assert [r.batch for r in results] == [1, 3]
    for r in results:
        assert r.same_tokens is True
        assert r.baseline == "transformers" and r.moekit_tok_s > 0 and r.baseline_tok_s > 0
        assert r.ratio == pytest.approx(r.moekit_tok_s / r.baseline_tok_s)
        assert r.roofline_tok_s == pytest.approx(r.batch * 20e9 / r.bytes_per_step)


def test_a_baseline_that_runs_batch_one_only_leaves_the_other_batches_unmeasured(tiny_checkpoints):
    class OnlyBatchOne:
        name = "batch-one"

        def supports(self, batch):
            return batch == 1

        def timer(self, prompts, new_tokens):
            return lambda: 1.0

        def tokens(self, prompts, new_tokens):
            return engine.generate(prompts.tolist(), max_new_tokens=new_tokens, stop_ids=()).token_ids

        def info(self):
            return {}

    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    settings = BenchSettings(batches=(1, 2), tokens=4, prompt_len=3, repeats=1, warmup=0)
    one, two = bench_decode(engine, settings, baseline=OnlyBatchOne(), bandwidth_bytes_s=None)
    assert (one.baseline, one.baseline_tok_s, one.same_tokens) == ("batch-one", 1.0, True)
    assert (two.baseline, two.baseline_tok_s, two.same_tokens, two.ratio) == (None, None, None, None)
