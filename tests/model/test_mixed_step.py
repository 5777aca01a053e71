"""The mixed step (moekit.model.mixed_step): the running rows' decode tokens and one chunk of a
prompt in one forward, eager and compiled, against the two separate forwards it replaces (the
decode step, then the prompt's prefill: decode_step / prefill_step, themselves held to the modules'
forward in test_decode_step.py and test_prefill_step.py).

It must give the rows' and the chunk's last token's fp32 logits within 1e-4, the same experts for
every row and chunk token, and the same KV in both caches, for grouped-query attention (qwen3_moe)
and latent attention (deepseek_v3); compiled, one graph serves every row count past 1, chunk length
and start, and greedy tokens fed back step after step are the eager engine's.
"""

from __future__ import annotations

import functools

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.model.cache import copy_row
from moekit.model.compiled_step import MIXED, MIXED_STEP
from moekit.model.decoder import decode_step
from moekit.model.mixed_step import mixed_step
from moekit.model.prefill_step import prefill_step
from tests.model.engine_pairs import eager_and_compiled

ROWS = [[5, 9, 33, 7], [12, 40, 41, 3, 8, 70], [2, 6]]  # the running rows' tokens so far
PROMPT = [11, 4, 19, 23, 31, 2, 17, 9, 44, 6, 13]  # the prompt prefilled in chunks
FAMILIES = ("qwen3_moe", "deepseek_v3")


def _running(decoder, rows=ROWS):
    """A cache of len(rows) + 1 rows, each holding its row's tokens but the last (prefilled alone,
    as the scheduler does) → (cache, ids [B, 1] of each row's last token, lengths [B])."""
    cache = decoder.new_cache(len(rows) + 1, 16)
    with torch.inference_mode():
        for i, row in enumerate(rows):
            single = decoder.new_cache(1, len(row) - 1)
            decoder.forward_modules(torch.tensor([row[:-1]]), single, torch.arange(len(row) - 1)[None])
            copy_row(cache, i, single, 0, len(row) - 1)
    ids = torch.tensor([[row[-1]] for row in rows])
    return cache, ids, torch.tensor([len(row) - 1 for row in rows])


def _prompt_cache(decoder, done: int):
    """The prompt's own cache (a slot spare, as the scheduler's chunked prefills keep), its first
    `done` tokens in it."""
    cache = decoder.new_cache(1, len(PROMPT) + 1)
    with torch.inference_mode():
        if done:
            decoder.forward_modules(torch.tensor([PROMPT[:done]]), cache, torch.arange(done)[None])
    return cache


def _clone(cache):
    copy = type(cache)(layers=[], key_mask=cache.key_mask.clone(), length=cache.length, stack=cache.stack.clone())
    return copy


def _separate(decoder, cache, ids, lengths, chunk_cache, chunk):
    """decode_step over the rows, then prefill_step over the chunk: (logits [B + 1, V], chosen [L, B + T, K])."""
    b, end, start = ids.shape[0], int(lengths.max()) + 1, chunk_cache.length
    decoder.rope.reserve(cache.max_len)  # the caches may be another decoder's (the compiled engine's)
    with torch.inference_mode():
        rows, chosen, _, _ = decode_step(decoder, ids[:, 0], lengths, lengths, cache.key_mask[:b, :end], cache.stack,
                                         decoder.rope.cos_table, decoder.rope.sin_signed_table)
        last, chunk_chosen, _, _ = prefill_step(decoder, torch.tensor([chunk]), torch.arange(start, start + len(chunk))[None],
                                                chunk_cache.key_mask[:, : start + len(chunk)], chunk_cache.stack,
                                                decoder.rope.cos_table, decoder.rope.sin_signed_table)
    return torch.cat((rows, last)), torch.cat((chosen, chunk_chosen), dim=1)


def _form(decoder, cache, ids, lengths, chunk_cache, chunk):
    b, end, start = ids.shape[0], int(lengths.max()) + 1, chunk_cache.length
    with torch.inference_mode():
        logits, chosen, _, _ = mixed_step(decoder, ids[:, 0], lengths, lengths, cache.key_mask[:b, :end],
                                          torch.tensor([chunk]), torch.arange(start, start + len(chunk))[None],
                                          chunk_cache.key_mask[:, : start + len(chunk)], cache.stack, chunk_cache.stack,
                                          decoder.rope.cos_table, decoder.rope.sin_signed_table)
    return logits, chosen


def _agree(got, want, caches):
    (got_logits, got_chosen), (want_logits, want_chosen) = got, want
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_chosen, want_chosen)
    for a, b in caches:
        torch.testing.assert_close(a.stack, b.stack, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mixed_form_run_eagerly_is_the_separate_forwards(tiny_checkpoints, family):
    decoder = load_engine(tiny_checkpoints(family), compile=False).decoder
    for done, size in ((0, 4), (4, 7)):  # a first chunk, and the last after the KV of one before it
        cache, ids, lengths = _running(decoder)
        chunk_cache = _prompt_cache(decoder, done)
        chunk = PROMPT[done : done + size]
        theirs = (_clone(cache), _clone(chunk_cache))
        want = _separate(decoder, *theirs[:1], ids, lengths, theirs[1], chunk)
        got = _form(decoder, cache, ids, lengths, chunk_cache, chunk)
        _agree(got, want, [(cache, theirs[0]), (chunk_cache, theirs[1])])


@pytest.fixture(scope="module")
def compiled(tiny_checkpoints):
    """family → (eager engine, compiled engine with its mixed step's graph compiled, and nothing else)."""

    def get(family: str):
        eager, engine = eager_and_compiled(tiny_checkpoints(family))
        engine.decoder.compiled.warm_up(batches=(), prefills=(MIXED_STEP,))
        return eager, engine

    return functools.cache(get)


def _mixed_graphs(engine) -> int:
    return sum(len(graphs) for key, graphs in engine.decoder.compiled._graphs.items() if key[0] == MIXED)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_mixed_step_is_the_separate_forwards_and_feeds_back_the_same_greedy_tokens(compiled, family):
    """Chunks of 4, 5 and 2 tokens of the prompt, each in one compiled step with 3, then 2 running rows
    whose next tokens are the argmax of the step before: the eager separate forwards' logits, experts
    and tokens at every step, and one graph for them all."""
    eager, engine = compiled(family)
    step = engine.decoder.compiled
    assert step.mixes and _mixed_graphs(engine) == 1
    cache, ids, lengths = _running(engine.decoder)
    chunk_cache = _prompt_cache(engine.decoder, 0)
    theirs = (_clone(cache), _clone(chunk_cache))
    done = 0
    for size, b in ((4, 3), (5, 3), (2, 2)):
        chunk = PROMPT[done : done + size]
        want = _separate(eager.decoder, theirs[0], ids[:b], lengths[:b], theirs[1], chunk)
        calls = step.direct_steps
        decisions, chunk_decisions = [], []
        with torch.inference_mode():
            out = engine.decoder.forward_mixed(ids[:b], cache, lengths[:b], torch.tensor([chunk]), chunk_cache,
                                               decisions, chunk_decisions)
        assert out is not None and step.direct_steps == calls + 1  # the warmed-up graph ran it
        rows, last = out
        got_chosen = torch.cat((torch.stack([d.topk_ids for _, d in decisions]),
                                torch.stack([d.topk_ids for _, d in chunk_decisions])), dim=1)
        _agree((torch.cat((rows[:, 0], last[:, 0])), got_chosen), want, [(cache, theirs[0]), (chunk_cache, theirs[1])])
        assert rows[:, 0].argmax(-1).tolist() == want[0][:b].argmax(-1).tolist()
        theirs[1].length = chunk_cache.length = done = done + size
        ids, lengths = rows[:, 0].argmax(-1)[:, None], lengths[:b] + 1
    assert _mixed_graphs(engine) == 1


def test_what_the_mixed_step_does_not_hold_runs_the_separate_forwards(compiled):
    """One running row, a one-token chunk, a decoder not compiled: forward_mixed runs nothing (None)."""
    eager, engine = compiled("qwen3_moe")
    cache, ids, lengths = _running(engine.decoder)
    chunk_cache = _prompt_cache(engine.decoder, 0)
    with torch.inference_mode():
        assert engine.decoder.forward_mixed(ids[:1], cache, lengths[:1], torch.tensor([PROMPT[:3]]), chunk_cache) is None
        assert engine.decoder.forward_mixed(ids, cache, lengths, torch.tensor([PROMPT[:1]]), chunk_cache) is None
        assert eager.decoder.forward_mixed(ids, cache, lengths, torch.tensor([PROMPT[:3]]), chunk_cache) is None
    assert chunk_cache.length == 0
