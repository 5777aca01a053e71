"""A prompt's prefill in the decode step's form (moekit.model.prefill_step), eager and compiled,
against the modules' forward (Decoder.forward_modules, itself held to transformers in tests/engine).

The form must give the last token's fp32 logits within 1e-4, the same experts for every prompt
token and the same KV in the cache, for a lone prompt, a left-padded batch and a chunk that goes on
after the slots a first chunk wrote; compiled, one graph per row count (1, or several) serves every
prompt length and start, and greedy tokens through the default path are the eager engine's.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.model.compiled_step import PREFILL, PrefillShape
from moekit.model.prefill_step import prefill_step, takes
from tests.model.engine_pairs import eager_and_compiled

PROMPTS = [[5, 9, 33, 7, 81, 14, 3, 60], [12, 40, 41]]


def _batch(rows: list[list[int]]):
    """Left-padded ids, positions [B, T] and the padding's length per row."""
    width = max(map(len, rows))
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[0] * p + r for p, r in zip(pads, rows)])
    positions = torch.tensor([[0] * p + list(range(len(r))) for p, r in zip(pads, rows)])
    return ids, positions, pads


def _prefill(decoder, rows, run, chunk: int = 0):
    """Prefill `rows` (a first chunk of `chunk` tokens by the modules' forward, then the rest by
    `run`) → (last logits [B, V], decisions of the rest's tokens per MoE layer [B*T, K], the cache)."""
    ids, positions, pads = _batch(rows)
    cache = decoder.new_cache(len(rows), ids.shape[1] + 2)
    for r, p in enumerate(pads):
        cache.key_mask[r, :p] = False
    with torch.inference_mode():
        if chunk:
            decoder.forward_modules(ids[:, :chunk], cache, positions[:, :chunk])
        logits, chosen = run(decoder, ids[:, chunk:], cache, positions[:, chunk:])
    return logits.reshape(len(rows), -1), chosen, cache


def _modules(decoder, ids, cache, positions):
    decisions: list = []
    logits = decoder.forward_modules(ids, cache, positions, decisions, last_only=True)
    return logits, [d.topk_ids for _, d in decisions]


def _form(decoder, ids, cache, positions):
    """prefill_step run eagerly, as the compiled graph is traced from it."""
    end = cache.length + ids.shape[1]
    logits, chosen, _, _ = prefill_step(decoder, ids, positions, cache.key_mask[:, :end], cache.stack,
                                        decoder.rope.cos_table, decoder.rope.sin_signed_table)
    cache.length = end
    return logits, list(chosen.unbind(0))


def _default(decoder, ids, cache, positions):
    decisions: list = []
    logits = decoder(ids, cache, positions, decisions, last_only=True)
    return logits, [d.topk_ids for _, d in decisions]


def _agree(got, want):
    (got_logits, got_ids, got_cache), (want_logits, want_ids, want_cache) = got, want
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert len(got_ids) == len(want_ids) and all(torch.equal(a, b) for a, b in zip(got_ids, want_ids))
    torch.testing.assert_close(got_cache.stack, want_cache.stack, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ("qwen3_moe", "deepseek_v3", "gpt_oss", "olmoe", "llama4_text", "granitemoe"))
def test_the_prefill_form_run_eagerly_is_the_modules_forward(tiny_checkpoints, family):
    """Grouped-query attention with q/k norms (qwen3_moe, olmoe's whole-projection one), MLA
    (deepseek_v3), sinks and sliding windows (gpt_oss), llama4's chunked / NoPE attention and
    input-weighed experts, granitemoe's multipliers."""
    decoder = load_engine(tiny_checkpoints(family), compile=False).decoder
    for rows, chunk in (([PROMPTS[0]], 0), (PROMPTS, 0), ([PROMPTS[0]], 3)):
        _agree(_prefill(decoder, rows, _form, chunk), _prefill(decoder, rows, _modules, chunk))


# gpt_oss's compiled prefill (sinks, windows, packed MXFP4 experts at many rows) is served by
# tests/serve/test_compiled_server.py's MXFP4 server, against the eager engine's tokens.
COMPILED = ("qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def compiled(tiny_checkpoints):
    """family → (eager engine, compiled engine with its one-row prefill graph compiled)."""

    def get(family: str):
        eager, engine = eager_and_compiled(tiny_checkpoints(family))
        engine.decoder.compiled.warm_up(batches=(), prefills=(PrefillShape(1, full=False),))
        return eager, engine

    return functools.cache(get)


def _prefill_graphs(engine) -> int:
    return sum(len(graphs) for key, graphs in engine.decoder.compiled._graphs.items() if key[0] == PREFILL)


@pytest.mark.parametrize("family", COMPILED)
def test_the_compiled_prefill_is_the_modules_forward_for_every_length_and_start(compiled, family):
    eager, engine = compiled(family)
    assert _prefill_graphs(engine) == 1
    for prompt, chunk in ((PROMPTS[0], 0), (PROMPTS[1], 0), (PROMPTS[0], 3), (PROMPTS[0] + PROMPTS[1], 5)):
        calls = engine.decoder.compiled.direct_steps
        _agree(_prefill(engine.decoder, [prompt], _default, chunk), _prefill(eager.decoder, [prompt], _modules, chunk))
        assert engine.decoder.compiled.direct_steps == calls + 1  # the warmed-up graph ran it
    assert _prefill_graphs(engine) == 1
    assert all(graph.calls_inner for graph in engine.decoder.compiled.graphs)  # confirmed while warming up


def test_greedy_tokens_and_chunked_prefill_through_the_compiled_prefill_are_the_eager_engines(compiled):
    """generate (the prompt prefilled by the graph) and the scheduler prefilling the same prompt in
    chunks of 3 (each chunk the graph, after the KV of the ones before) give the eager tokens."""
    eager, engine = compiled("qwen3_moe")
    prompt = PROMPTS[0] + PROMPTS[1]
    want = eager.generate([prompt], max_new_tokens=8, stop_ids=()).token_ids
    assert engine.generate([prompt], max_new_tokens=8, stop_ids=()).token_ids == want
    scheduler = Scheduler(engine.decoder, max_batch=2, prefill_tokens=3)
    outcome, = generate_batch(scheduler, [Request(prompt=prompt, max_new_tokens=8)])
    assert outcome.token_ids == want[0], outcome.error
    # The last chunk fills the scheduler's cache of the prompt's size, a graph of its own that is not warmed up
    # here: it ran the modules' forward (a prompt never waits for a compile), with the same tokens.
    assert _prefill_graphs(engine) == 1


def test_prompts_run_the_modules_forward_until_their_graph_is_ready_with_the_same_tokens(tiny_checkpoints):
    """A server compiles its prefill graphs while it answers (warm_up_prefills, on a thread of its own):
    before a shape's graph is ready its prompts run the modules' forward, after it the graph; the
    tokens are the eager engine's either way, also while the graph compiles beside the steps."""
    folder = tiny_checkpoints("qwen3_moe")
    want = load_engine(folder, compile=False).generate([PROMPTS[0]], max_new_tokens=6, stop_ids=()).token_ids
    engine = load_engine(folder, compile=True)
    engine.decoder.compile_decode(cpp_wrapper=False)
    step = engine.decoder.compiled
    step.warm_up(batches=(1,))
    assert not step.prefills
    stopped = threading.Event()
    stopped.set()
    step.warm_up_prefills((PrefillShape(1, full=False),), stop=stopped)  # turned on, nothing compiled yet
    assert step.prefills and _prefill_graphs(engine) == 0
    calls = step.direct_steps
    assert engine.generate([PROMPTS[0]], max_new_tokens=6, stop_ids=()).token_ids == want
    assert step.direct_steps == calls + 5  # the decode steps only: the prompt ran the modules' forward

    said: list = []
    shapes = (PrefillShape(1, full=True), PrefillShape(1, full=False))
    beside = threading.Thread(target=step.warm_up_prefills, args=(shapes, said.append))
    beside.start()
    while beside.is_alive():  # prompts while the graphs compile: whichever path each takes, the same tokens
        assert engine.generate([PROMPTS[0]], max_new_tokens=6, stop_ids=()).token_ids == want
    beside.join()
    assert "the prefill graphs (1 row full, 1 row) one at a time" in said[0], said  # compiling, or loading what an earlier process saved
    assert [line.split(")")[0] for line in said[1:]] == ["prefill graph (1 row full", "prefill graph (1 row"], said
    assert all(" in " in line and line.endswith("its prompts run it from now") for line in said[1:]), said
    assert _prefill_graphs(engine) == 2
    calls = step.direct_steps
    assert engine.generate([PROMPTS[0]], max_new_tokens=6, stop_ids=()).token_ids == want
    assert step.direct_steps == calls + 6  # the prompt too, by its graph


def test_what_the_prefill_form_does_not_hold_runs_the_modules_forward(tiny_checkpoints):
    decoder = load_engine(tiny_checkpoints("qwen3_moe"), compile=False).decoder
    assert takes(decoder, None, None, last_only=True) is None
    assert "every position" in takes(decoder, None, None, last_only=False)
    assert "own K" in takes(decoder, [2] * 8, None, last_only=True)
