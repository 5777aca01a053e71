"""The compiled decode step against the eager one, on tiny checkpoints written by save_pretrained.

The eager Decoder is itself held to transformers (tests/engine); here the compiled step must give
the same greedy tokens and fp32 logits within 1e-4 for batch 1, a left-padded batch, and
continuous batching's rows at different lengths — for every family, and for MXFP4 / FP8 experts
kept packed. Options it does not run (the expert store) must say so and stay eager.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.model.cache import copy_row
from moekit.model.step_ops import contract
from moekit.ops.build import cpu_flags
from moekit.model.linear import TILES, Linear
from moekit.model.experts import RoutedExperts
from moekit.model.expert_forms import Int8Stacks, Packed
from moekit.model.moe import Router
from moekit.model.routing import PolicyRun, parse_policy
from tests.engine.hf_tiny import FEWER_LAYERS, MOE_FAMILIES, write_checkpoint
from tests.model.engine_pairs import eager_and_compiled
from tests.weights.quantized_files import FP8_PARTIAL, write_fp8, write_mxfp4

COMPILED = MOE_FAMILIES  # every family, llama4's chunked / NoPE attention and input-weighed experts included


@pytest.fixture(scope="module")
def engines(tiny_checkpoints, tmp_path_factory):
    """family → (eager engine, compiled engine) of the same checkpoint: hf_tiny's, or where that
    repeats a kind of layer, each kind once (hf_tiny.FEWER_LAYERS; the eager step is held to
    transformers at hf_tiny's size in tests/engine)."""

    def get(family: str):
        folder = tiny_checkpoints(family) if family not in FEWER_LAYERS else write_checkpoint(
            family, tmp_path_factory.mktemp(family), **FEWER_LAYERS[family])
        return eager_and_compiled(folder)

    return functools.cache(get)


# Batch 1 has a graph of its own (Dynamo specialises a size of 1), whose attention products are
# `contract`, not einsum, where no operator attends (sinks; MLA's absorbed projections). These
# families run it too; every family runs a batch's graph (the costly part of each case is compiling).
BATCH_1_TOO = ("qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text")


@pytest.mark.parametrize("family", COMPILED)
def test_compiled_step_matches_eager(engines, family):
    eager, compiled = engines(family)
    assert compiled.decoder.compiled is not None, compiled.notes
    assert any("compiled graph" in n for n in compiled.notes)
    prompts = [[5, 9, 33, 7, 81, 14, 3, 60], [12, 40, 41]]  # left-padded as a batch
    batches = ([prompts[0]], prompts) if family in BATCH_1_TOO else (prompts,)
    for batch in batches:
        want = eager.generate(batch, max_new_tokens=12, stop_ids=()).token_ids
        got = compiled.generate(batch, max_new_tokens=12, stop_ids=()).token_ids
        assert got == want, f"{family}: batch of {len(batch)}"
    # After the first step of each graph, steps call the graph Inductor made without Dynamo.
    assert compiled.decoder.compiled.direct_steps >= len(batches) * 12 - 2 * len(batches)
    # Logits of decode steps, through the same cache positions on both sides.
    outs = []
    for engine in (eager, compiled):
        dec = engine.decoder
        cache = dec.new_cache(2, 16)
        cache.key_mask[1, :5] = False  # row 1 left-padded by 5
        ids = torch.tensor([prompts[0], [0] * 5 + prompts[1]])
        pos = torch.tensor([list(range(8)), [0] * 5 + [0, 1, 2]])
        with torch.inference_mode():
            dec(ids, cache, pos)
            step = [dec(torch.tensor([[17], [23]]), cache, torch.tensor([[8 + s], [3 + s]])) for s in range(3)]
        outs.append(torch.cat(step, 1))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    if family in BATCH_1_TOO:
        torch.testing.assert_close(_step_logits(compiled, prompts[0]), _step_logits(eager, prompts[0]), rtol=1e-4, atol=1e-4)


def test_a_full_caches_last_step_gets_a_graph_of_its_own_and_matches_eager(engines):
    """The step that fills the cache's last slot is outside the steady graph's shape guards (the
    visible length equals the cache's): it must not run that graph directly, and still decode right."""
    eager, compiled = engines("qwen3_moe")
    outs = []
    for engine in (eager, compiled):
        dec, prompt = engine.decoder, [5, 9, 33, 7]
        cache = dec.new_cache(1, 8)
        with torch.inference_mode():
            dec(torch.tensor([prompt]), cache, torch.arange(4)[None])
            outs.append(torch.cat([dec(torch.tensor([[17 + s]]), cache, torch.tensor([[4 + s]])) for s in range(4)], 1))
        assert cache.length == cache.max_len
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    step = compiled.decoder.compiled
    full, roomy = _full_step_inputs(compiled.decoder), _full_step_inputs(compiled.decoder, full=False)
    takes_full = [g for g in step.graphs if g.accepts(full)]
    takes_roomy = [g for g in step.graphs if g.accepts(roomy)]
    assert len(takes_full) == 1 and len(takes_roomy) == 1 and takes_full[0] is not takes_roomy[0]


def _full_step_inputs(dec, full: bool = True):
    """The inputs CompiledStep passes its graphs for batch 1 writing slot 7 of an 8-slot cache
    (full) or of a 16-slot one."""
    cache = dec.new_cache(1, 8 if full else 16)
    with torch.inference_mode():
        tables = dec.compiled._held(cache.stack, dec.rope)
        small = [torch.zeros(1, dtype=torch.int64), torch.full((1,), 7), torch.full((1,), 7), cache.key_mask[:, :8].clone()]
    return (*small, cache.stack, *tables)


@pytest.mark.parametrize(
    "equation, left, right",
    [("bkgd,bksd->bkgs", (1, 4, 2, 16), (1, 4, 9, 16)), ("bkgs,bksd->bkgd", (1, 4, 2, 9), (1, 4, 9, 16)),
     ("bhn,hnr->bhr", (1, 8, 16), (8, 16, 32)), ("bhn,hnr->bhr", (3, 8, 16), (8, 16, 32)),
     ("bhr,hrv->bhv", (3, 8, 32), (8, 32, 16)), ("bhc,bsc->bhs", (2, 3, 40), (2, 7, 40)), ("ij,jk->ki", (3, 5), (5, 4))],
)
def test_contract_is_einsum(equation, left, right):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(left, generator=gen), torch.randn(right, generator=gen)
    got = contract(equation, a, b)
    want = torch.einsum(equation, a, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _rows_step(engine, top_k=None):
    """Continuous batching's step over 3 rows at lengths 6, 11, 2 → (logits [3, 1, V], the
    decision of each MoE layer)."""
    dec = engine.decoder
    cache = dec.new_cache(3, 24)
    lengths = torch.tensor([6, 11, 2])
    with torch.inference_mode():
        for r, n in enumerate(lengths.tolist()):
            single = dec.new_cache(1, n)
            dec(torch.arange(3, 3 + n)[None] + r, single, torch.arange(n)[None])
            copy_row(cache, r, single, 0, n)
        decisions = []
        logits = dec.forward_rows(torch.tensor([[7], [8], [9]]), cache, lengths, decisions, top_k=top_k)
    return logits, [d for _, d in decisions]


@pytest.mark.parametrize("family", ("qwen3_moe", "gpt_oss", "deepseek_v3"))
def test_compiled_rows_match_eager(engines, family):
    """Continuous batching's step: rows at their own lengths, slot = position, in one call."""
    (want, want_routes), (got, got_routes) = (_rows_step(engine) for engine in engines(family))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a.topk_ids, b.topk_ids) for a, b in zip(want_routes, got_routes))


def test_a_row_k_past_the_models_runs_compiled_and_matches_eager(engines):
    """A row wider than the model's K: the step's decisions are that wide (StepRouting.width, a
    graph of its own), each row routed by the family's rule at its own K, as the eager step."""
    eager, compiled = engines("qwen3_moe")
    widest = compiled.decoder.widest_k
    ks = [widest + 1, 1, widest]
    (want, want_routes), (got, got_routes) = _rows_step(eager, ks), _rows_step(compiled, ks)
    assert any(r.width == widest + 1 for r in compiled.decoder.compiled._graphs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(want_routes, got_routes):
        assert b.topk_ids.shape[1] == widest + 1
        for row, k in enumerate(ks):
            assert torch.equal(b.topk_ids[row, :k], a.topk_ids[row, :k])
            torch.testing.assert_close(b.topk_weights[row, :k], a.topk_weights[row, :k], rtol=1e-5, atol=1e-6)
            assert not b.topk_weights[row, k:].any()


def _switching_steps(decoder, stacked: bool) -> list:
    """One row's steps whose routing changes from one step to the next: the model's K, a row's K
    below and past it, a policy, router health's entropy, and back → per step (token, logits [V],
    each MoE layer's (ids, entropy))."""
    widest = decoder.widest_k
    plan = ({}, {"top_k": [1]}, {}, {"policy": "topk:1"}, {}, {"top_k": [widest + 1]}, {"entropy": True}, {},
            {"top_k": [1]}, {"top_k": [widest]}, {})
    prompt = [5, 9, 33, 7, 81]
    cache = decoder.new_cache(1, len(prompt) + len(plan) + 1, stacked=stacked)
    steps = []
    try:
        with torch.inference_mode():
            logits = decoder.forward_modules(torch.tensor([prompt]), cache, torch.arange(len(prompt))[None])
            token = int(logits[0, -1].argmax())
            for s, how in enumerate(plan):
                decoder.entropy_watched = how.get("entropy", False)
                policy = PolicyRun(parse_policy(how["policy"], widest, 8), rows=1) if "policy" in how else None
                made: list = []
                logits = decoder.forward_rows(torch.tensor([[token]]), cache, torch.tensor([len(prompt) + s]), made,
                                              top_k=how.get("top_k"), policy=policy)
                token = int(logits[0, -1].argmax())
                steps.append((token, logits[0, -1], [(d.topk_ids, d.entropy) for _, d in made]))
    finally:
        decoder.entropy_watched = False
    return steps


def test_a_steps_routing_may_change_from_one_step_to_the_next(engines):
    """Decoder._step takes the common step's routing from two constants and seats no policy when
    it has none: steps that switch between the model's K, a row's own K, a policy and router
    health's entropy, and back, each decode as the modules' forward does (an unstacked cache: the
    plain reference) — the same tokens, logits within 1e-4, the same experts."""
    eager, compiled = engines("qwen3_moe")
    want, got = _switching_steps(eager.decoder, stacked=False), _switching_steps(compiled.decoder, stacked=True)
    assert [t for t, _, _ in got] == [t for t, _, _ in want]
    for (_, want_logits, want_layers), (_, got_logits, got_layers) in zip(want, got):
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
        for (want_ids, want_entropy), (got_ids, got_entropy) in zip(want_layers, got_layers, strict=True):
            k = want_ids.shape[1]  # a seated step's decision is padded to its width (seated_policy.padded)
            assert torch.equal(got_ids[:, :k], want_ids)
            assert (got_entropy is None) == (want_entropy is None)
            if want_entropy is not None:
                torch.testing.assert_close(got_entropy, want_entropy, rtol=1e-4, atol=1e-5)
    assert compiled.decoder.seat.policy is None


def test_a_decoder_may_trace_more_graphs_than_dynamos_default_limit(engines):
    """One decoder's steps make many graphs (batch 1 and a batch, per-row Ks, policies, router
    health, prefills): Dynamo's default of 8 recompiles per code object would run the ninth eagerly
    (found by the whole suite, where one test module's decoder steps through all of them). While the
    step traces, the limit is GRAPHS_PER_STEP; outside it is Dynamo's own."""
    from moekit.model.compiled_step import GRAPHS_PER_STEP

    _, compiled = engines("qwen3_moe")
    step = compiled.decoder.compiled
    seen = []
    outside = torch._dynamo.config.recompile_limit
    assert step._run(("no such routing",), (), (), lambda small: None, 3,
                     lambda: seen.append(torch._dynamo.config.recompile_limit) or ()) == []
    assert seen == [GRAPHS_PER_STEP] and GRAPHS_PER_STEP > 8
    assert torch._dynamo.config.recompile_limit == outside


@pytest.mark.parametrize("family", ("qwen3_moe", "llama4_text"))
def test_per_row_k_runs_compiled_and_matches_eager(engines, family):
    """Expert-budget tiers' per-row K (route_rows) in the compiled step: each row routed by the
    family's rule at its own K, the same experts, weights and logits as the eager step (a K wider
    than the model's: tests/model/test_step_routing.py). The graph is a batch's own (each row's K
    one more input), which warm_up(per_row_k=True) compiles before a server answers."""
    eager, compiled = engines(family)
    step = compiled.decoder.compiled
    widest = compiled.decoder.widest_k
    ks = [1, widest, max(1, widest - 1)]
    step.warm_up((2,), per_row_k=True)
    graphs = len(step.graphs)
    (want, want_routes), (got, got_routes) = _rows_step(eager, ks), _rows_step(compiled, ks)
    assert len(step.graphs) == graphs  # the warmed-up graph ran the rows
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(want_routes, got_routes):
        for row, k in enumerate(ks):
            assert torch.equal(b.topk_ids[row, :k], a.topk_ids[row, :k])
            torch.testing.assert_close(b.topk_weights[row, :k], a.topk_weights[row, :k], rtol=1e-5, atol=1e-6)
            assert not b.topk_weights[row, k:].any()  # the padding adds nothing


@pytest.mark.parametrize("family,operator", [("deepseek_v3", "has_latent_attend"), ("qwen3_moe", "has_attend")])
def test_attention_without_its_operator_matches_eager(engines, monkeypatch, family, operator):
    """Where moekit::latent_attend (MLA) or moekit::attend (grouped-query) is not built, attention
    over the cache is Inductor's contractions (batch 1) and einsum (a batch): the same tokens and
    logits as the eager step too."""
    from moekit.model import step_ops

    eager, _ = engines(family)
    monkeypatch.setattr(step_ops, operator, lambda: False)
    plain = load_engine(eager.folder, compile=True)
    plain.decoder.compile_decode(cpp_wrapper=False)
    prompts = [[5, 9, 33, 7, 81, 14, 3, 60], [12, 40, 41]]
    for batch in ([prompts[0]], prompts):
        want = eager.generate(batch, max_new_tokens=8, stop_ids=()).token_ids
        assert plain.generate(batch, max_new_tokens=8, stop_ids=()).token_ids == want
    torch.testing.assert_close(_step_logits(plain, prompts[0]), _step_logits(eager, prompts[0]), rtol=1e-4, atol=1e-4)


def _step_logits(engine, prompt: list[int], steps: int = 3) -> torch.Tensor:
    """Logits of `steps` decode steps after a prefill of `prompt`, batch 1 (a slot to spare: the step
    that fills a cache is a graph of its own, which test_a_full_caches_last_step... compiles)."""
    dec = engine.decoder
    cache = dec.new_cache(1, len(prompt) + steps + 1)
    with torch.inference_mode():
        dec(torch.tensor([prompt]), cache, torch.arange(len(prompt))[None])
        out = [dec(torch.tensor([[17 + s]]), cache, torch.tensor([[len(prompt) + s]])) for s in range(steps)]
    return torch.cat(out, 1)


@pytest.mark.parametrize("family, weights", [("qwen3_moe", "int8"), ("deepseek_v3", "int8"), ("gpt_oss", "int8-experts")])
def test_int8_compiled_matches_eager_int8(tmp_path, family, weights):
    """q8_0 weights in the compiled step (moekit::rows_q8 / experts_q8) against the eager int8 engine."""
    folder = write_checkpoint(family, tmp_path / family, **FEWER_LAYERS.get(family, {}))
    eager = load_engine(folder, weights=weights, compile=False)
    compiled = load_engine(folder, weights=weights, compile=True)
    assert compiled.decoder.compiled is not None, compiled.notes
    compiled.decoder.compile_decode(cpp_wrapper=False)  # the same kernels, a quicker compile
    ex = next(b.ffn.experts for b in compiled.decoder.layers if hasattr(b.ffn, "experts"))
    assert isinstance(ex.form, Int8Stacks) and ex.form.stacks[0].dtype == torch.uint8
    heads = [e.decoder.lm_head for e in (eager, compiled)]
    if weights == "int8" and heads[0] is not None:
        assert all(h.weight.dtype == torch.uint8 for h in heads)  # the head is int8 on both sides
    prompts = [[5, 9, 33, 7, 81, 14, 3, 60], [12, 40, 41]]
    for batch in ([prompts[0]], prompts):
        want = eager.generate(batch, max_new_tokens=10, stop_ids=()).token_ids
        assert compiled.generate(batch, max_new_tokens=10, stop_ids=()).token_ids == want, f"batch of {len(batch)}"
    torch.testing.assert_close(_step_logits(compiled, prompts[0]), _step_logits(eager, prompts[0]), rtol=1e-4, atol=1e-4)


# Checkpoints in the published quantized layouts (tests/weights/quantized_files.py) whose routed
# experts stay packed: gpt-oss's MXFP4, DeepSeek-V3's block-scaled FP8 with partial blocks at the edges.
PACKED = {"mxfp4": write_mxfp4, "fp8-partial": lambda folder: write_fp8(folder, shape=FP8_PARTIAL, **FEWER_LAYERS["deepseek_v3"])}


@pytest.fixture(scope="module")
def packed_engines(tmp_path_factory):
    """kind → (eager engine, compiled engine) of one packed checkpoint."""
    made = {}

    def get(kind: str):
        if kind not in made:
            folder = PACKED[kind](tmp_path_factory.mktemp(kind))
            compiled = load_engine(folder, compile=True)
            compiled.decoder.compile_decode(cpp_wrapper=False)  # the same kernels, a quicker compile
            made[kind] = (load_engine(folder, compile=False), compiled)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", sorted(PACKED))
def test_packed_experts_compiled_match_eager(packed_engines, kind):
    """MXFP4 / FP8 experts kept packed in the compiled step (moekit::experts_mxfp4 / experts_fp8 on
    the packed stacks) against the eager packed engine: the same greedy tokens at batch 1 and in a
    left-padded batch, fp32 logits within 1e-4, and steps that call the recorded graph directly."""
    eager, compiled = packed_engines(kind)
    assert compiled.decoder.compiled is not None, compiled.notes
    for engine in (eager, compiled):
        ex = next(b.ffn.experts for b in engine.decoder.layers if hasattr(b.ffn, "experts"))
        assert isinstance(ex.form, Packed) and ex.form.stacks[0].dtype == torch.uint8
    prompts = [[5, 9, 33, 7, 81, 14, 3, 60], [12, 40, 41]]
    for batch in ([prompts[0]], prompts):
        want = eager.generate(batch, max_new_tokens=12, stop_ids=()).token_ids
        assert len(set(want[0])) >= 3  # a continuation that says something, not one token repeated
        assert compiled.generate(batch, max_new_tokens=12, stop_ids=()).token_ids == want, f"{kind}: batch of {len(batch)}"
    assert compiled.decoder.compiled.direct_steps >= 2 * 12 - 4
    torch.testing.assert_close(_step_logits(compiled, prompts[0]), _step_logits(eager, prompts[0]), rtol=1e-4, atol=1e-4)
    (want, want_routes), (got, got_routes) = _rows_step(eager), _rows_step(compiled)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a.topk_ids, b.topk_ids) for a, b in zip(want_routes, got_routes))


def _swap_reaches_the_compiled_step(engines) -> None:
    """engines: (eager, compiled) of one checkpoint. Every expert of the first MoE layer becomes
    expert 0 in both: the compiled step's logits change, and equal the eager ones'."""
    engines[1].decoder.compile_decode(cpp_wrapper=False)
    prompt = [5, 9, 33, 7]
    before = _step_logits(engines[1], prompt)
    for engine in engines:
        ex = next(b.ffn.experts for b in engine.decoder.layers if hasattr(b.ffn, "experts"))
        gate_up, down = ex.resident_weights(0)
        for e in range(ex.num_experts):  # every expert of the layer becomes expert 0
            ex.replace_expert(e, (gate_up.clone(), down.clone()))
    after = [_step_logits(engine, prompt) for engine in engines]
    assert not torch.allclose(after[1], before)
    torch.testing.assert_close(after[1], after[0], rtol=1e-4, atol=1e-4)


def test_a_hot_swap_reaches_the_packed_stacks_the_compiled_step_reads(tmp_path):
    """replace_expert writes into the packed stacks: the compiled step reads the new expert."""
    folder = write_mxfp4(tmp_path / "mxfp4")
    engines = [load_engine(folder, compile=c) for c in (False, True)]
    _swap_reaches_the_compiled_step(engines)


def test_int8_hot_swap_reaches_the_compiled_step(tmp_path):
    """replace_expert writes into the q8_0 stacks the compiled step reads. (Every weight int8, as
    test_int8_compiled_matches_eager_int8[qwen3_moe-int8]: the same model, so its graph, compiled
    earlier in the run, is loaded from the compile cache.)"""
    folder = write_checkpoint("qwen3_moe", tmp_path / "q")
    engines = [load_engine(folder, weights="int8", compile=c) for c in (False, True)]
    _swap_reaches_the_compiled_step(engines)


# Widths that fit the tiles layout (16 | out, 32 | in) in every projection and expert stack but the
# routers', so that on an AMX machine the compiled bf16 step lays them out in tiles (lay_out_tiles).
TILES_FIT = {
    "qwen3_moe": dict(hidden_size=64, head_dim=16),
    "deepseek_v3": dict(hidden_size=64, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
}


def _bf16_batch_logits(engine) -> torch.Tensor:
    """A 2-row prefill (eager), then 3 decode steps' logits [2, 3, V]."""
    dec, cache = engine.decoder, engine.decoder.new_cache(2, 16)
    prompts = torch.tensor([[5, 9, 33, 7, 81, 14, 3, 60], [12, 40, 41, 2, 7, 8, 9, 10]])
    with torch.inference_mode():
        dec(prompts, cache, torch.arange(8)[None].expand(2, 8))
        return torch.cat([dec(torch.tensor([[17 + s], [23 + s]]), cache, torch.full((2, 1), 8 + s)) for s in range(3)], 1)


def _bf16_engines(folder):
    """(eager bf16 engine, compiled bf16 engine) of one checkpoint."""
    eager = load_engine(folder, dtype="bfloat16", compile=False)
    compiled = load_engine(folder, dtype="bfloat16", compile=True)
    compiled.decoder.compile_decode(cpp_wrapper=False)
    return eager, compiled


# The tiles cases exist only where the CPU has AMX: elsewhere they would run the plain cases' code at
# other widths (tests/model/test_tiled_experts.py forces the tiles layout on every machine instead).
AMX = {"amx_bf16", "amx_tile"} <= set(cpu_flags())
BF16_CASES = [("qwen3_moe", False), ("deepseek_v3", False)] + ([("qwen3_moe", True), ("deepseek_v3", True)] if AMX else [])


@pytest.mark.parametrize("family,tiles", BF16_CASES, ids=[f + ("-widths-for-tiles" if t else "") for f, t in BF16_CASES])
def test_a_bf16_batch_step_stays_within_bf16_rounding_of_the_eager_step(tmp_path, family, tiles):
    """bf16 runs other kernels than the eager reference (bf16 pairs, AMX tiles, a batch widened to fp32
    where moekit.ops.widen_batch measured that faster here, or weights laid out in tiles), so logits agree
    to bf16's rounding, not to 1e-4. With widths that fit, an AMX machine lays the weights out in
    tiles, and the eager prefill of the compiled engine reads them through the TILES kernel."""
    from moekit.ops import tiles_ready

    folder = write_checkpoint(family, tmp_path / "q", **FEWER_LAYERS.get(family, {}), **(TILES_FIT[family] if tiles else {}))
    eager, compiled = _bf16_engines(folder)
    modules = list(compiled.decoder.modules())
    laid_out = sum(1 for m in modules if getattr(m, "kernel", None) is TILES) + sum(2 for m in modules if getattr(m, "kernels", None) == (TILES, TILES))
    if not tiles_ready():
        assert laid_out == 0
    elif tiles:
        assert all(m.kernel is TILES for m in modules if isinstance(m, Linear) and not isinstance(m, Router))
        assert all(m.kernels == (TILES, TILES) for m in modules if isinstance(m, RoutedExperts))
    want, got = _bf16_batch_logits(eager), _bf16_batch_logits(compiled)
    assert want.abs().max() > 0.5  # logits of some size, so that the bound below means something
    torch.testing.assert_close(got, want, rtol=0, atol=0.06)


def _a_hot_swap_reaches_experts_laid_out_in_tiles(tmp_path):
    """replace_expert writes into the tiled stacks the compiled step (and the eager prefill) read."""
    folder = write_checkpoint("qwen3_moe", tmp_path / "q", **TILES_FIT["qwen3_moe"])
    engines = _bf16_engines(folder)
    before = _bf16_batch_logits(engines[1])
    for engine in engines:
        ex = next(b.ffn.experts for b in engine.decoder.layers if hasattr(b.ffn, "experts"))
        gate_up, down = ex.resident_weights(0)  # in each engine's own layout
        for e in range(ex.num_experts):  # every expert of the layer becomes expert 0
            ex.replace_expert(e, (gate_up.clone(), down.clone()))
    assert engines[1].decoder.layers[0].ffn.experts.kernels == (TILES, TILES)
    after = [_bf16_batch_logits(engine) for engine in engines]
    assert (after[1] - before).abs().max() > 0.1
    torch.testing.assert_close(after[1], after[0], rtol=0, atol=0.06)

# Collected only where the CPU has AMX (a test elsewhere would run nothing of its own);
# tests/model/test_tiled_experts.py checks a hot swap into tiled stacks on every machine.
if AMX:
    test_a_hot_swap_reaches_experts_laid_out_in_tiles = _a_hot_swap_reaches_experts_laid_out_in_tiles


def test_a_compiled_decoder_is_freed_with_its_engine(tmp_path):
    """Dynamo keeps every backend it is given for the life of the process: the step's backend must
    not keep the decoder, and with it every weight, alive after the engine is gone."""
    folder = write_checkpoint("qwen3_moe", tmp_path / "q")
    engine = load_engine(folder, compile=True)
    engine.decoder.compile_decode(cpp_wrapper=False)
    engine.generate([[5, 9, 33, 7]], max_new_tokens=4, stop_ids=())
    assert engine.decoder.compiled.direct_steps > 0
    decoder = weakref.ref(engine.decoder)
    del engine
    gc.collect()
    assert decoder() is None


def test_a_cache_without_a_stack_is_refused_by_the_step_and_decoded_eagerly(engines):
    """Decoder.new_cache stacks every layer's tensors (the compiled step's one cache input); a cache
    put together otherwise is run by the eager step, with the same logits."""
    _, compiled = engines("qwen3_moe")
    dec = compiled.decoder
    stacked = dec.new_cache(1, 8)
    loose = dec.new_cache(1, 8)
    loose.stack = None
    ids, pos = torch.tensor([[5, 9, 33]]), torch.tensor([[0, 1, 2]])
    with torch.inference_mode():
        dec(ids, stacked, pos)
        dec(ids, loose, pos)
        with pytest.raises(ValueError, match="stacked cache"):
            dec.compiled(torch.tensor([[7]]), loose, torch.tensor([3]), torch.tensor([3]), loose.key_mask[:, :4])
        got = [dec(torch.tensor([[7]]), cache, torch.tensor([[3]])) for cache in (stacked, loose)]
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)


def test_a_servers_warm_up_takes_every_batch_of_its_cache_a_lone_request_included(tiny_checkpoints):
    """A server's steps read its cache of max-batch rows whatever the batch: warmed up with those rows
    (warm_up(rows=...)), batch 1's graph and the batch graph take a lone row, a few and all of them,
    nothing compiled on a request, the eager step's logits."""
    folder = tiny_checkpoints("qwen3_moe")
    eager, compiled = load_engine(folder, compile=False), load_engine(folder, compile=True)
    compiled.decoder.compile_decode(cpp_wrapper=False)
    step = compiled.decoder.compiled
    step.warm_up((1, 2), rows=4)
    assert len(step.graphs) == 2
    calls = step.direct_steps
    for b in (1, 3, 4):
        got, want = [], []
        for engine, out in ((compiled, got), (eager, want)):
            cache = engine.decoder.new_cache(4, 16)
            with torch.inference_mode():
                out.append(engine.decoder.forward_rows(torch.arange(5, 5 + b)[:, None], cache, torch.arange(b) + 2))
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert len(step.graphs) == 2 and step.direct_steps == calls + 3  # each step ran a warmed-up graph
    assert all(graph.calls_inner for graph in step.graphs)  # confirmed while warming up: Inductor's code alone


def test_a_server_compiles_the_prefill_graphs_its_prompts_can_take():
    """served_prefills: several rows' graph only where several rows are prefilled together, a
    chunk's (1 row, not full) only where a prompt can be longer than a step's prefill tokens, and the
    mixed step's (a chunk in the running rows' decode) only there too, where two rows can run beside it."""
    from moekit.model.compiled_step import SERVED_PREFILLS, served_prefills

    alone, chunk, burst, mixed = SERVED_PREFILLS
    assert (alone, chunk, burst, mixed) == ((1, True, False), (1, False, False), (2, True, False), (1, False, True))
    assert served_prefills(max_batch=4, max_len=4096, prefill_tokens=2048) == (alone, chunk, burst, mixed)
    assert served_prefills(max_batch=1, max_len=4096, prefill_tokens=2048) == (alone, chunk)
    assert served_prefills(max_batch=2, max_len=4096, prefill_tokens=2048) == (alone, chunk, burst)
    assert served_prefills(max_batch=4, max_len=2048, prefill_tokens=2048) == (alone, burst)  # never chunked
    assert served_prefills(max_batch=1, max_len=256, prefill_tokens=2048) == (alone,)
    assert served_prefills(max_batch=4, max_len=256, prefill_tokens=8) == (alone, chunk, burst, mixed)
