"""Chunked prefill is exact: a prompt prefilled a chunk per step, between the running rows' decode
steps, gives what a whole prefill gives, and the running rows keep decoding while it goes on.

The oracles: moekit's lone `generate` (itself held to transformers' in
test_generate_vs_transformers.py), which prefills each prompt in one forward, and log_softmax of
one whole forward for the prompt's logprobs.
"""

from __future__ import annotations

import pytest
import torch

from hf_tiny import DENSE_FAMILIES, MOE_FAMILIES
from moekit.engine.loader import load_engine
from moekit.engine.prefix_cache import PrefixCache
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.errors import MoekitError

LONG = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]  # 23 tokens
SHORT = [1, 17, 42, 99]


def alone(engine, prompt, new):
    return engine.generate([prompt], max_new_tokens=new, stop_ids=()).token_ids[0]


def whole_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of one forward over all of `ids`: [T, V], row t predicts ids[t + 1]."""
    with torch.inference_mode():
        cache = engine.decoder.new_cache(1, len(ids))
        logits = engine.decoder(torch.tensor([ids]), cache, torch.arange(len(ids))[None])  # [1, T, V]
    return torch.log_softmax(logits[0].float(), dim=-1)


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_a_prompt_prefilled_in_chunks_gets_its_whole_prefill_tokens(family, tiny_checkpoints):
    engine = load_engine(tiny_checkpoints(family), compile=False)
    # 5 prompt tokens a step: the 23-token prompt takes 5 steps, the 4-token one fits in one; the
    # long one arrives while the short one decodes, then a second long one while both decode.
    scheduler = Scheduler(engine.decoder, max_batch=4, prefill_tokens=5)
    requests = [Request(prompt=SHORT, max_new_tokens=14), Request(prompt=LONG, max_new_tokens=8),
                Request(prompt=LONG[3:] + SHORT, max_new_tokens=5)]
    outcomes: dict[int, object] = {}
    for i, request in enumerate(requests):
        request.on_finish = lambda outcome, i=i: outcomes.__setitem__(i, outcome)
    scheduler.submit(requests[0])
    scheduler.step()
    scheduler.submit(requests[1])
    scheduler.step()
    assert scheduler.num_prefilling == 1  # its first chunk done, four to go
    scheduler.submit(requests[2])
    scheduler.run_until_idle()
    for request, i in zip(requests, range(3)):
        assert outcomes[i].finish_reason == "length", outcomes[i].error
        assert outcomes[i].token_ids == alone(engine, list(request.prompt), request.max_new_tokens), f"{family}: request {i}"


def test_running_rows_decode_every_step_while_a_long_prompt_is_prefilled(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    steps: list = []
    scheduler = Scheduler(engine.decoder, max_batch=4, prefill_tokens=4, on_step=steps.append)
    got: list[int] = []
    running = Request(prompt=SHORT, max_new_tokens=12, on_token=got.append)
    scheduler.submit(running)
    scheduler.step()
    long = Request(prompt=LONG, max_new_tokens=3)
    scheduler.submit(long)
    during = []
    while scheduler.num_prefilling or scheduler.num_waiting:
        before = len(got)
        scheduler.step()
        during.append(len(got) - before)
    # ceil(23 / 4) = 6 steps of prefill, each with a decode step of the running row in it.
    assert during == [1] * 6
    assert [s.batch for s in steps[1:6]] == [1] * 5 and steps[6].batch == 2  # the long one runs from its last chunk's step
    assert [s.admitted for s in steps[1:7]] == [0, 0, 0, 0, 0, 1]
    scheduler.run_until_idle()
    assert got == alone(engine, SHORT, 12)


@pytest.mark.parametrize("new", [0, 2])
def test_prompt_logprobs_across_chunks_are_the_whole_forwards(tiny_checkpoints, new):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    scored: list = []
    request = Request(prompt=LONG, max_new_tokens=new, prompt_logprobs=2, on_prompt_logprobs=scored.append)
    [outcome] = generate_batch(Scheduler(engine.decoder, max_batch=2, prefill_tokens=6), [request])
    [entries] = scored
    reference = whole_logprobs(engine, LONG)
    assert entries[0] is None and [e.token for e in entries[1:]] == LONG[1:]
    for i, entry in enumerate(entries[1:]):
        assert entry.logprob == pytest.approx(float(reference[i, LONG[i + 1]]), abs=1e-4)
        assert [t for t, _ in entry.top] == reference[i].topk(2).indices.tolist()
    assert outcome.finish_reason == "length" and outcome.token_ids == (alone(engine, LONG, new) if new else [])


def test_chunks_after_a_cached_prefix_give_the_cold_tokens_and_usage(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("olmoe"), compile=False)
    shared = list(range(3, 35))  # two 16-token blocks
    prompts = [shared + [40, 41, 42], shared + list(range(50, 63))]  # the second: 13 tokens after its cached 32
    cold = [generate_batch(Scheduler(engine.decoder, max_batch=2), [Request(prompt=p, max_new_tokens=6)])[0]
            for p in prompts]
    chunked = Scheduler(engine.decoder, max_batch=2, prefill_tokens=4, prefix_cache=PrefixCache(budget_bytes=1 << 30))
    warm = [generate_batch(chunked, [Request(prompt=p, max_new_tokens=6)])[0] for p in prompts]
    for c, w in zip(cold, warm):
        assert w.token_ids == c.token_ids
        assert w.usage.experts_touched == c.usage.experts_touched
    assert [o.cached_tokens for o in warm] == [0, 32]
    # The first prompt's blocks, computed over 9 chunks, are what the second found: its tokens prove them.


def test_a_request_cancelled_while_its_prompt_is_prefilled_leaves(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=2, prefill_tokens=4)
    long = Request(prompt=LONG, max_new_tokens=4)
    other = Request(prompt=SHORT, max_new_tokens=4)
    outcomes = {}
    for name, request in (("long", long), ("other", other)):
        request.on_finish = lambda outcome, name=name: outcomes.__setitem__(name, outcome)
        scheduler.submit(request)
    scheduler.step()
    assert scheduler.num_prefilling == 1
    scheduler.cancel(long)
    scheduler.run_until_idle()
    assert outcomes["long"].finish_reason == "cancelled" and outcomes["long"].token_ids == []
    assert scheduler.num_prefilling == 0
    assert outcomes["other"].token_ids == alone(engine, SHORT, 4)


@pytest.mark.parametrize("tokens, left, size", [(8, 20, 8), (8, 9, 7), (8, 8, 8), (2, 3, 3), (1, 2, 2), (1, 3, 3),
                                                (1, 5, 2), (1, 1, 1), (30, 31, 29), (30, 12, 12)])
def test_a_chunk_neither_is_nor_leaves_one_token(tokens, left, size):
    from moekit.engine.scheduler import chunk_tokens

    assert chunk_tokens(tokens, left) == size


def test_a_prefill_budget_below_one_token_is_refused(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    with pytest.raises(MoekitError, match="max-prefill-tokens must be at least 1, got 0"):
        Scheduler(engine.decoder, prefill_tokens=0)


def _served(engine, long_prompt, forwards: list, budget: int = 8):
    """Two short requests decoding, then a long one arriving, its prompt prefilled in chunks (at most
    `budget` tokens a step) → (outcomes; per step while it is prefilled: (the compiled graphs the step
    called, the prompt's tokens prefilled by its end))."""
    scheduler = Scheduler(engine.decoder, max_batch=4, prefill_tokens=budget)
    requests = [Request(prompt=SHORT, max_new_tokens=12), Request(prompt=SHORT[::-1], max_new_tokens=12),
                Request(prompt=long_prompt, max_new_tokens=3)]
    outcomes: dict[int, object] = {}
    for i, request in enumerate(requests):
        request.on_finish = lambda outcome, i=i: outcomes.__setitem__(i, outcome)
    scheduler.submit_all(requests[:2])
    scheduler.step()
    scheduler.submit(requests[2])
    step = engine.decoder.compiled
    while scheduler.num_waiting or scheduler.num_prefilling:
        calls = step.direct_steps if step is not None else 0
        scheduler.step()
        done = scheduler._fill.done if scheduler._fill is not None else len(long_prompt)
        forwards.append(((step.direct_steps if step is not None else 0) - calls, done))
    scheduler.run_until_idle()
    return [outcomes[i] for i in range(3)]


def test_a_chunk_rides_in_the_running_rows_decode_forward_with_everyones_solo_tokens(tiny_checkpoints):
    """Compiled, with its mixed step's graph ready (moekit.model.mixed_step), each chunk of the long
    prompt and the running rows' decode are ONE compiled call a step (the separate forwards were two:
    the chunk's prefill graph, warmed up here too, then the decode's); every request gets the tokens
    it gets alone (the long one: prefilled whole, as generate does) and the eager scheduler's usage.
    A chunk that rides takes at most MIXED_TOKENS less the running rows (2) of a larger budget. No
    forward on a prompt's own cache or on a row's own cache compiles a graph mid-serving."""
    from moekit.engine.scheduler import MIXED_TOKENS
    from moekit.model.compiled_step import MIXED_STEP, PrefillShape
    from tests.model.engine_pairs import eager_and_compiled

    eager, engine = eager_and_compiled(tiny_checkpoints("qwen3_moe"))
    engine.decoder.compiled.warm_up(batches=(2,), rows=4, prefills=(PrefillShape(1, full=False), MIXED_STEP))
    longer = [(7 * i) % 150 + 3 for i in range(150)]
    riding = MIXED_TOKENS - 2
    # LONG[:17] at 8 a step would leave its last token alone (chunk_tokens): 8, 7, 2.
    for prompt, budget, chunks in ((LONG, 8, [8, 16, 23]), (LONG[:17], 8, [8, 15, 17]),
                                   (longer, 128, [*range(riding, 150, riding), 150])):
        forwards: list = []
        got = _served(engine, prompt, forwards, budget)
        assert forwards == [(1, done) for done in chunks]  # each chunk in its step's one call
        want = _served(eager, prompt, [], budget)
        for outcome, theirs, asked, new in zip(got, want, (SHORT, SHORT[::-1], prompt), (12, 12, 3)):
            assert outcome.finish_reason == "length", outcome.error
            assert outcome.token_ids == theirs.token_ids == alone(eager, list(asked), new)
            assert outcome.usage.experts_touched == theirs.usage.experts_touched
            assert outcome.active_params == theirs.active_params
    # One-token prompts (alone, and two at once): the modules' forward, not a decode step on the
    # prompt's cache, which would compile a graph of its own mid-serving.
    scheduler = Scheduler(engine.decoder, max_batch=4)
    generate_batch(scheduler, [Request(prompt=[5, 6], max_new_tokens=3)])  # batch 1's decode graph (a server warms it up)
    graphs = len(engine.decoder.compiled.graphs)
    got = generate_batch(scheduler, [Request(prompt=[5], max_new_tokens=3)])
    got += generate_batch(scheduler, [Request(prompt=[5], max_new_tokens=3), Request(prompt=[9], max_new_tokens=3)])
    assert [o.token_ids for o in got] == [alone(eager, [5], 3), alone(eager, [5], 3), alone(eager, [9], 3)]
    # Rows run one by one (a canary's, or after a batched step raised): the warmed batch-1 graph.
    scheduler.submit_all([Request(prompt=SHORT, max_new_tokens=4), Request(prompt=SHORT[::-1], max_new_tokens=4)])
    scheduler.step()
    with torch.inference_mode():
        scheduler._decode_alone()
    scheduler.run_until_idle()
    assert len(engine.decoder.compiled.graphs) == graphs
