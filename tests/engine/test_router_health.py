"""Router health: entropy of the full routing distribution, its drift over position, ITL jitter."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.engine import router_health as rh
from moekit.engine.loader import load_engine
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.engine.trace import trace_model, trace_table


def test_entropy_by_hand():
    uniform = torch.zeros(2, 8)
    assert rh.routing_entropy(uniform).tolist() == pytest.approx([math.log(8)] * 2)
    peaked = torch.tensor([[100.0, 0.0, 0.0, 0.0]])
    assert rh.routing_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)
    two = torch.tensor([[0.0, 0.0, -1e4, -1e4]])  # half and half: ln 2
    assert rh.routing_entropy(two).item() == pytest.approx(math.log(2))
    # a sigmoid router: scores 0.5, 0.5 normalised to 1/2 each
    assert rh.routing_entropy(torch.zeros(1, 2), "sigmoid").item() == pytest.approx(math.log(2))


def test_jitter_index_by_hand():
    # gaps 1, 1, 2: mean 4/3, population std sqrt(2/9) → 0.3536
    assert rh.jitter_index([0.0, 1.0, 2.0, 4.0]) == pytest.approx(math.sqrt(2 / 9) / (4 / 3))
    assert rh.jitter_index([0.0, 1.0, 2.0]) == 0.0
    assert rh.jitter_index([0.0, 1.0]) is None


def test_drift_flags_a_collapsing_layer_and_a_jittery_request():
    e = 16
    layers, positions, entropy = [], [], []
    for p in range(128):
        layers += [0, 1]
        positions += [p, p]
        entropy += [(0.9 if p < 64 else 0.3) * math.log(e), 0.8 * math.log(e)]
    drift = rh.entropy_drift(layers, positions, entropy, {0: e, 1: e})
    assert [d.buckets for d in drift][0] == [(0, pytest.approx(0.9), 64), (64, pytest.approx(0.3), 64)]
    assert drift[0].collapses and not drift[1].collapses
    flags = rh.health_flags(drift, {"request 7": 0.9, "request 8": 0.2})
    assert len(flags) == 2 and flags[0].startswith("layer 0:") and flags[1].startswith("request 7:")


def test_watching_the_routers_fills_the_trace_and_changes_no_token(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    prompt = [1, 17, 42, 99, 5]
    plain = engine.generate([prompt], max_new_tokens=6, stop_ids=())
    with rh.watch_entropy(engine.decoder):
        watched = engine.generate([prompt], max_new_tokens=6, stop_ids=())
    assert watched.token_ids == plain.token_ids
    table = trace_table(watched, trace_model(engine.spec))
    e = trace_model(engine.spec).num_experts
    values = table["entropy"].to_pylist()
    assert table["entropy"].null_count == 0 and all(0 < h <= math.log(e) + 1e-5 for h in values)
    assert trace_table(plain)["entropy"].null_count == trace_table(plain).num_rows  # not watched: null
    after = engine.generate([prompt], max_new_tokens=2, stop_ids=())  # the hooks are gone after the block
    assert all(lr.entropy is None for step in after.routing for lr in step.layers)


def test_the_scheduler_tallies_decode_entropy_by_layer_and_position(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=2)
    stop = rh.watch_routers(engine.decoder)
    try:
        generate_batch(scheduler, [Request(prompt=[1, 2, 3], max_new_tokens=5), Request(prompt=[4, 5], max_new_tokens=4)])
    finally:
        stop()
    snapshot = scheduler.entropy.snapshot()
    layers = {layer for layer, _ in snapshot}
    assert layers == set(scheduler.moe_layers)
    per_layer = sum(n for (layer, _), (_, n) in snapshot.items() if layer == scheduler.moe_layers[0])
    assert per_layer == (5 - 1) + (4 - 1)  # decode passes: one per generated token after the first
    assert all(0 < v <= 1 for v, _ in snapshot.values())


PROMPT = [5, 9, 33, 7, 81, 14, 3, 60]


def _entropy_by_hooks(decoder, steps: int) -> list:
    """The old way, as the reference: forward hooks on the routers, each computing the entropy of
    the logits of the router's input, over the modules' forward → [step][MoE layer] entropy [1]."""
    from moekit.model.moe import Router

    seen: list = []
    hook = lambda module, args, decision: seen.append(rh.routing_entropy(module.logits(args[0]), module.spec.scoring))
    handles = [m.register_forward_hook(hook) for m in decoder.modules() if isinstance(m, Router)]
    cache, out = decoder.new_cache(1, 16), []
    try:
        decoder.forward_modules(torch.tensor([PROMPT]), cache, torch.arange(8)[None])
        for s in range(steps):
            seen.clear()
            decoder.forward_modules(torch.tensor([[17 + s]]), cache, torch.tensor([[8 + s]]))
            out.append(list(seen))
    finally:
        for handle in handles:
            handle.remove()
    return out


def _entropy_by_steps(decoder, steps: int) -> list:
    """The watched decoder's T = 1 steps (decode_step, eager or compiled) → the same shape."""
    cache, out = decoder.new_cache(1, 16), []
    with rh.watch_entropy(decoder):
        decoder(torch.tensor([PROMPT]), cache, torch.arange(8)[None])
        for s in range(steps):
            decisions: list = []
            decoder(torch.tensor([[17 + s]]), cache, torch.tensor([[8 + s]]), decisions=decisions)
            out.append([d.entropy for _, d in decisions])
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_decode_steps_entropy_is_what_hooks_on_the_routers_saw(tiny_checkpoints, family):
    """Router health reads the entropy off the step's own router logits (eager and compiled): the
    figures the routers' forward hooks gave, on a fixed prompt (sigmoid scoring: deepseek_v3)."""
    folder = tiny_checkpoints(family)
    eager = load_engine(folder, compile=False).decoder
    runs = [(eager, 1e-6)]
    if family == "deepseek_v3":  # compiled: qwen3_moe's by the scheduler's tally below
        compiled = load_engine(folder, compile=True).decoder
        compiled.compile_decode(cpp_wrapper=False)  # a quarter of the compile time, the same kernels
        runs.append((compiled, 1e-4))
    with torch.inference_mode():
        want = _entropy_by_hooks(eager, 3)
        for decoder, tolerance in runs:
            got = _entropy_by_steps(decoder, 3)
            assert [len(layers) for layers in got] == [len(layers) for layers in want] == [len(eager.moe_layers)] * 3
            for got_step, want_step in zip(got, want):
                for g, w in zip(got_step, want_step):
                    torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance)
    assert all(d.compiled.direct_steps > 0 for d, _ in runs[1:])  # the compiled graph ran the steps


def test_a_compiled_scheduler_tallies_the_eager_ones_entropy(tiny_checkpoints):
    """A server's router health with --compile: the same tally per layer and position as eager."""
    folder = tiny_checkpoints("qwen3_moe")
    compiled = load_engine(folder, compile=True).decoder
    compiled.compile_decode(cpp_wrapper=False)
    tallies = []
    for decoder in (load_engine(folder, compile=False).decoder, compiled):
        scheduler = Scheduler(decoder, max_batch=2)
        with rh.watch_entropy(decoder):
            generate_batch(scheduler, [Request(prompt=[1, 2, 3], max_new_tokens=5), Request(prompt=[4, 5], max_new_tokens=5)])
        tallies.append(scheduler.entropy.snapshot())
    eager, steps = tallies
    assert eager.keys() == steps.keys() and eager
    for key, (value, n) in eager.items():
        assert steps[key][1] == n == 8  # two rows, four decode passes each
        assert steps[key][0] == pytest.approx(value, rel=1e-4)
