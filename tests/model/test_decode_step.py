"""The decode step's form (each module's `decode`, moekit.model.decoder.decode_step) run eagerly,
without torch.compile, against the modules' forward (Decoder.forward_modules): the code the compiled
step captures is the same code, so it must decode right on its own; and an eager Decoder's T = 1
forward is that step (Decoder.steps_in_form), bit for bit, where the step's form holds its options. Cheap (no compile), so every family runs, each
with per-row K (expert-budget tiers) too; tests/model/test_compiled_step.py holds the compiled graph
to the eager forward."""

from __future__ import annotations

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.model.decoder import decode_step
from tests.engine.hf_tiny import MOE_FAMILIES

PROMPTS = ([5, 9, 33, 7, 81, 14, 3, 60], [12, 40, 41])  # row 1 left-padded by 5


def _prefilled(decoder):
    """A 2-row cache after an eager prefill of PROMPTS, left-padded, and the rows' next positions."""
    cache = decoder.new_cache(2, 16)
    cache.key_mask[1, :5] = False
    ids = torch.tensor([PROMPTS[0], [0] * 5 + PROMPTS[1]])
    decoder(ids, cache, torch.tensor([list(range(8)), [0] * 5 + [0, 1, 2]]))
    return cache, torch.tensor([8, 3])


def _forward_steps(decoder, top_k=None, through=None) -> torch.Tensor:
    """3 decode steps of the modules' forward (or `through`, a Decoder method) after the prefill
    → logits [2, 3, V]."""
    cache, positions = _prefilled(decoder)
    step = through or decoder.forward_modules
    steps = [step(torch.tensor([[17 + s], [23 + s]]), cache, (positions + s)[:, None], top_k=top_k) for s in range(3)]
    return torch.cat(steps, 1)


def _decode_steps(decoder, top_k=None) -> torch.Tensor:
    """The same 3 steps through decode_step, uncompiled → logits [2, 3, V]."""
    cache, positions = _prefilled(decoder)
    rope, out = decoder.rope, []
    ks = None if top_k is None else torch.tensor(top_k)
    for s in range(3):
        slot = torch.full((2,), cache.length, dtype=torch.int64)
        ids = torch.tensor([17 + s, 23 + s])
        logits, _, _, _ = decode_step(decoder, ids, slot, positions + s, cache.key_mask[:, : cache.length + 1],
                                   cache.stack, rope.cos_table, rope.sin_signed_table, ks)
        cache.length += 1
        out.append(logits[:, None])
    return torch.cat(out, 1)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_decode_step_run_eagerly_matches_the_forward(tiny_checkpoints, family):
    folder = tiny_checkpoints(family)
    reference = load_engine(folder, compile=False).decoder
    hub = load_engine(folder, kernels="auto", compile=True).decoder  # the Hub layout decode_step reads
    with torch.inference_mode():
        torch.testing.assert_close(_decode_steps(hub), _forward_steps(reference), rtol=1e-4, atol=1e-4)
        k = next(b.ffn.router.spec.top_k for b in hub.layers if hasattr(b.ffn, "router"))
        ks = [1, k]
        torch.testing.assert_close(_decode_steps(hub, ks), _forward_steps(reference, ks), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_an_eager_decoders_step_is_the_decode_step(tiny_checkpoints, family):
    """Decoder.forward at T = 1 without compile runs decode_step: the same logits to the bit, and
    the same routing decisions (routing policies and K past the model's: tests/model/test_step_routing.py)."""
    decoder = load_engine(tiny_checkpoints(family), compile=False).decoder  # the eager kernels' layouts
    with torch.inference_mode():
        assert torch.equal(_forward_steps(decoder, through=decoder.forward), _decode_steps(decoder))
        cache, positions = _prefilled(decoder)
        assert decoder.steps_in_form(cache)
        ids = torch.tensor([[17], [23]])
        stepped, walked = [], []
        logits = decoder(ids, cache, positions[:, None], decisions=stepped)
        cache.length -= 1  # the same step again, through the modules
        reference = decoder.forward_modules(ids, cache, positions[:, None], decisions=walked)
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        assert [layer for layer, _ in stepped] == [layer for layer, _ in walked]
        for (_, a), (_, b) in zip(stepped, walked):
            assert torch.equal(a.topk_ids, b.topk_ids)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_row_k_past_the_models_runs_the_step_and_leaves_the_other_rows_alone(tiny_checkpoints, family):
    """A row asking for more experts than the model's K (the family's rule widened: routing.with_k)
    runs the decode step, whose decisions are then that wide, and gets the modules' forward's
    logits; a row at the model's K beside it gets what it gets without any per-row K."""
    decoder = load_engine(tiny_checkpoints(family), compile=False).decoder
    k = decoder.widest_k
    ks = [k + 1, k]
    assert decoder.step_routing(ks, None).width == k + 1
    with torch.inference_mode():
        want = _forward_steps(decoder, ks)
        got = _forward_steps(decoder, ks, through=decoder.forward)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        plain = _forward_steps(decoder, through=decoder.forward)
        torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1].argmax(-1), plain[1].argmax(-1))


def test_a_row_k_above_the_experts_is_refused_in_one_line(tiny_checkpoints):
    decoder = load_engine(tiny_checkpoints("qwen3_moe"), compile=False).decoder
    with pytest.raises(ValueError, match="a row asks for 9 experts per token; the model's MoE layers have 8"):
        _forward_steps(decoder, [9, 1], through=decoder.forward)



def _step_operators(engine, prompt: list[int]) -> tuple[list[int], list[tuple[str, list]]]:
    """Greedy tokens of 6 eager steps after the prompt, and the (name, input shapes) of the ops they ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        tokens = engine.generate(prompt, max_new_tokens=6, stop_ids=()).token_ids[0]
    return tokens, [(event.key, event.input_shapes) for event in prof.key_averages(group_by_input_shape=True)]


def _ran(ops: list[tuple[str, list]], operator: str, weight: list[int] | None = None) -> bool:
    """Whether one of moekit's builds ran `operator` (on a weight of that shape, where given)."""
    return any(name.startswith("moekit") and operator in name and (weight is None or shapes[1] == weight) for name, shapes in ops)


@pytest.mark.parametrize("family,tied", [("qwen3_moe", False), ("qwen3_moe", True), ("deepseek_v3", False)],
                         ids=["qwen3_moe", "qwen3_moe-tied", "deepseek_v3"])
def test_the_eager_step_runs_the_row_operators_its_command_loaded(tmp_path, tiny_checkpoints, family, tied):
    """An eager engine whose command loaded the operators (--kernels auto) runs its decode steps'
    projections, a tied head included, on moekit::rows_gemv and its experts on experts_gemv; under
    --kernels reference, in the same process (the operators registered), F.linear and no gemv
    operator (argmax's, moekit.ops.rows_argmax, gives torch's indices either way). Both give
    transformers' greedy tokens."""
    from hf_tiny import write_checkpoint
    from test_generate_vs_transformers import reference, reference_greedy

    folder = write_checkpoint(family, tmp_path / family, tie_word_embeddings=True) if tied else tiny_checkpoints(family)
    prompt = [1, 17, 42, 99, 5]
    want = reference_greedy(reference(folder), prompt, 6)
    loaded, plain = load_engine(folder, kernels="auto", compile=False), load_engine(folder, kernels="reference")
    table = list(loaded.decoder.embed.weight.shape)  # [V, D]
    assert (loaded.decoder.lm_head is None) == tied
    with torch.inference_mode():
        tokens, ran = _step_operators(loaded, prompt)
        assert tokens == want
        assert _ran(ran, "rows_gemv", table) and _ran(ran, "experts_gemv")
        tokens, ran = _step_operators(plain, prompt)
        assert tokens == want
        assert not _ran(ran, "gemv") and "aten::linear" in {name for name, _ in ran}
