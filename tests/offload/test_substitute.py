"""Substitution on a cache miss (--substitute int4, HOBBIT): a paged run whose misses run the
expert's resident int4 copy counts them, stays close to exact, and without it nothing changes."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import write_checkpoint
from moekit.engine.loader import load_engine
from moekit.errors import MoekitError
from moekit.model.int4 import dequantize_q4_0
from moekit.offload.options import OffloadOptions
from offload_files import PROMPTS, greedy_runs

NEW = 16


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=1)


def test_without_substitution_the_tokens_are_the_resident_engines(qwen):
    want = greedy_runs(qwen, None, new=NEW)[:2]
    single, batch, stats = greedy_runs(qwen, OffloadOptions("25%"), new=NEW)
    assert (single, batch) == want and stats["substituted"] == 0 and stats["substitute_bytes"] == 0


def test_misses_run_the_int4_stand_in_and_are_counted(qwen):
    resident = greedy_runs(qwen, None, new=NEW)
    single, batch, stats = greedy_runs(qwen, OffloadOptions("25%", substitute="int4"), new=NEW)
    assert stats["substitute"] == "int4"
    # every miss runs a stand-in; so may a hit whose full copy is still loading
    misses = round(stats["accesses"] * (1 - stats["hit_rate"]))
    assert misses <= stats["substituted"] <= stats["accesses"] and stats["stall_s"] == 0.0
    assert stats["substitute_bytes"] > 0
    assert [len(r) for r in single] == [len(r) for r in resident[0]]
    # int4 copies of a random tiny model: the first greedy token of every prompt still agrees
    assert [r[0] for r in single] == [r[0] for r in resident[0]]


def test_a_stand_in_computes_the_int4_dequantized_expert(qwen):
    engine = load_engine(qwen, offload=OffloadOptions("25%", substitute="int4"), compile=False)
    try:
        layer, store = next(iter(engine.store.layers.items()))
        experts = engine.decoder.layers[layer].ffn.experts
        full = load_engine(qwen, compile=False).decoder.layers[layer].ffn.experts
        x = torch.randn(3, experts.in_features[0], generator=torch.Generator().manual_seed(0))
        ins = store.stand_ins[5]
        got = experts.apply_expert(5, ins.gate_up, ins.down, x, ins.kernels)
        gate_up, down = (dequantize_q4_0(w, n) for w, n in ((ins.gate_up, x.shape[1]), (ins.down, ins.down.shape[1] * 2)))
        want = torch.nn.functional.linear(experts.act(torch.nn.functional.linear(x, gate_up)), down)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        exact = full.apply_expert(5, *full.resident_weights(5), x)
        assert (got - exact).abs().max() < 0.2 * exact.abs().max()  # an approximation, not another expert
    finally:
        engine.close()


def test_substitute_needs_the_store_and_a_known_form(capsys):
    from cli_runner import moekit

    code, _, err = moekit(capsys, "run", "--eager", "hello", "--max-new-tokens", "2", "--substitute", "int4")
    assert code == 2 and "need --expert-memory" in err
    code, _, err = moekit(capsys, "run", "--eager", "hello", "--max-new-tokens", "2", "--expert-memory", "50%", "--substitute", "int3")
    assert code == 2 and "the forms are int4" in err and err.count("\n") == 1
