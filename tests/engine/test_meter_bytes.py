"""Bytes a pass touched, one rule everywhere: the meter, the serve scheduler and bench decode count
int8 / packed experts at the bytes they hold, not at the engine dtype's bytes per weight."""

from __future__ import annotations

import math

import pytest

from moekit.engine.loader import load_engine
from moekit.engine.meter import params_per_token, pass_bytes
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.model.linear import Linear
from moekit.model.moe import Router

pytest.importorskip("transformers")

PROMPT = [1, 17, 42, 99, 5, 63, 120]


def q8_0_bytes(out: int, inputs: int) -> int:
    """A weight [out, in] as q8_0: per 32 inputs (the last block padded) 32 int8 + a float16 scale."""
    return out * math.ceil(inputs / 32) * 34


def expert_q8_0_bytes(spec) -> int:
    """One gated routed expert: gate_up [2F, D] and down [D, F], from the format's definition."""
    expert = next(layer.ffn.expert for layer in spec.layers if layer.is_moe)
    d, f = expert.hidden_size, expert.width
    return q8_0_bytes(2 * f, d) + q8_0_bytes(d, f)


def test_pass_bytes_swaps_each_distinct_expert_for_the_bytes_it_holds(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    counts = params_per_token(engine.spec)
    layers = sorted(counts.top_k)
    chosen = {layers[0]: [3, 5, 5], layers[1]: [0]}  # a repeat reads its expert once: 3 distinct
    held = {(layers[0], 3): 100, (layers[0], 5): 200, (layers[1], 0): 300}
    plain = counts.touched({layers[0]: 2, layers[1]: 1}) * 4
    assert pass_bytes(counts, chosen, 4) == plain
    routed = (2 * counts.expert_each[layers[0]] + counts.expert_each[layers[1]]) * 4
    assert pass_bytes(counts, chosen, 4, lambda l, e: held[l, e]) == plain - routed + 600
    # Three rows of one batch: three embedding rows, the experts still read once.
    assert pass_bytes(counts, chosen, 4, rows=3) == plain + 2 * counts.embedding_row * 4


@pytest.mark.parametrize("weights", ["int8-experts", "int8"])
def test_a_scheduled_request_meters_int8_experts_as_moekit_run_does(tiny_checkpoints, weights):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), weights=weights, compile=False)
    metered = engine.meter(engine.generate([PROMPT], max_new_tokens=6, stop_ids=()))
    scheduler = Scheduler(engine.decoder, max_batch=2, bytes_per_param=engine.bytes_per_param,
                          expert_bytes=engine.expert_bytes, dense_saving=engine.dense_saving)
    usage = generate_batch(scheduler, [Request(prompt=PROMPT, max_new_tokens=6)])[0].usage
    assert usage.bytes_read_per_token == pytest.approx(sum(t.bytes_touched for t in metered) / 6)
    # Every token reads K distinct experts a layer, each q8_0 instead of fp32: a fixed saving; with
    # --weights int8 every other projection but the routers is q8_0 too (counted from an fp32 engine).
    counts = params_per_token(engine.spec)
    pairs = sum(counts.top_k.values())
    fp32 = counts.touched(counts.typical()) * 4
    saved = pairs * (counts.expert_each[min(counts.top_k)] * 4 - expert_q8_0_bytes(engine.spec))
    if weights == "int8":
        plain = load_engine(tiny_checkpoints("qwen3_moe"), compile=False).decoder
        linears = [m for m in plain.modules() if isinstance(m, Linear) and not isinstance(m, Router) and m.out_features > 1]
        assert linears
        saved += sum(m.in_features * m.out_features * 4 - q8_0_bytes(m.out_features, m.in_features) for m in linears)
    assert usage.bytes_read_per_token == fp32 - saved


def test_a_tier_b_row_pays_for_its_one_expert_at_int8(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), weights="int8-experts", compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=2, bytes_per_param=4, expert_bytes=engine.expert_bytes)
    full, one = generate_batch(scheduler, [Request(prompt=PROMPT, max_new_tokens=4),
                                           Request(prompt=PROMPT, max_new_tokens=4, tier="B")])
    counts = params_per_token(engine.spec)
    each = expert_q8_0_bytes(engine.spec)
    layers = {layer: 1 for layer in counts.top_k}
    want = (counts.touched(layers) - sum(counts.expert_each[l] for l in layers)) * 4 + len(layers) * each
    assert one.usage.bytes_read_per_token == want
    assert full.usage.bytes_read_per_token - want == sum(k - 1 for k in counts.top_k.values()) * each
