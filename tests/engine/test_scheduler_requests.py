"""What one scheduler request can ask beyond tokens, and what one bad request must not do to others:
logprobs of its tokens and of its prompt (against log_softmax of moekit's own forward), several
continuations sharing one prefill, and a request that fails while being set up failing alone."""

from __future__ import annotations

import threading

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.engine.sampling import SamplingParams
from moekit.engine.scheduler import Request, Scheduler, generate_batch

PROMPT = [1, 17, 42, 99, 5, 63, 120]
OTHER = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return load_engine(tiny_checkpoints("qwen3_moe"), compile=False)


def forward_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of moekit's own forward over `ids` in one pass: [T, V], row t predicts ids[t + 1]."""
    with torch.inference_mode():
        cache = engine.decoder.new_cache(1, len(ids))
        logits = engine.decoder(torch.tensor([ids]), cache, torch.arange(len(ids))[None])  # [1, T, V]
    return torch.log_softmax(logits[0].float(), dim=-1)


def alone(engine, prompt, new, sampling=SamplingParams()):
    return engine.generate([prompt], max_new_tokens=new, sampling=sampling, stop_ids=()).token_ids[0]


def test_token_logprobs_are_log_softmax_of_the_models_logits(engine):
    got: list = []
    request = Request(prompt=PROMPT, max_new_tokens=6, logprobs=3, on_logprob=got.append)
    [outcome] = generate_batch(Scheduler(engine.decoder, max_batch=4), [request])
    reference = forward_logprobs(engine, PROMPT + outcome.token_ids[:-1])[len(PROMPT) - 1 :]  # [6, V]
    assert [e.token for e in got] == outcome.token_ids
    for entry, row in zip(got, reference):
        assert entry.logprob == pytest.approx(float(row[entry.token]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        assert entry.top[0][0] == entry.token  # greedy: the chosen token is the most likely one


@pytest.mark.parametrize("new", [0, 1])
def test_prompt_logprobs_score_the_prompt_with_or_without_generating(engine, new):
    scored: list = []
    scoring = Request(prompt=PROMPT, max_new_tokens=new, prompt_logprobs=2, on_prompt_logprobs=scored.append)
    plain = Request(prompt=OTHER, max_new_tokens=3)  # admitted with it: one left-padded prefill
    outcomes = generate_batch(Scheduler(engine.decoder, max_batch=4), [scoring, plain])
    [entries] = scored
    reference = forward_logprobs(engine, PROMPT)
    assert entries[0] is None and [e.token for e in entries[1:]] == PROMPT[1:]
    for i, entry in enumerate(entries[1:]):
        assert entry.logprob == pytest.approx(float(reference[i, PROMPT[i + 1]]), abs=1e-4)
        assert [t for t, _ in entry.top] == reference[i].topk(2).indices.tolist()
    assert len(outcomes[0].token_ids) == new and outcomes[0].finish_reason == "length"
    assert outcomes[0].token_ids == alone(engine, PROMPT, new)[:new] if new else True
    assert outcomes[1].token_ids == alone(engine, OTHER, 3)


def test_continuations_of_one_prompt_share_a_prefill_and_each_gets_its_lone_tokens(engine):
    scheduler = Scheduler(engine.decoder, max_batch=8)
    seeds = [5, 6, 7]
    sampled = [Request(prompt=PROMPT, max_new_tokens=8, sampling=SamplingParams(temperature=1.0, seed=s)) for s in seeds]
    greedy = [Request(prompt=PROMPT, max_new_tokens=8) for _ in range(2)]
    prefills: list[int] = []
    forward = engine.decoder.forward

    def counting(ids, *args, **kwargs):
        if ids.shape[1] > 1:
            prefills.append(ids.shape[0])
        return forward(ids, *args, **kwargs)

    engine.decoder.forward = counting  # counts the rows of each prefill; the forward itself runs
    try:
        outcomes = generate_batch(scheduler, sampled + greedy + [Request(prompt=OTHER, max_new_tokens=4)])
    finally:
        del engine.decoder.forward
    assert prefills == [2]  # PROMPT once for five requests, OTHER once: one forward of two rows
    for seed, outcome in zip(seeds, outcomes):
        assert outcome.token_ids == alone(engine, PROMPT, 8, SamplingParams(temperature=1.0, seed=seed))
    assert outcomes[3].token_ids == outcomes[4].token_ids == alone(engine, PROMPT, 8)
    assert outcomes[5].token_ids == alone(engine, OTHER, 4)


def test_a_request_that_fails_during_setup_fails_alone_while_eight_stream(engine):
    scheduler = Scheduler(engine.decoder, max_batch=16)
    streams = [Request(prompt=[3 + i, 40, 41], max_new_tokens=12) for i in range(8)]
    bad = Request(prompt=PROMPT, max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=1))
    outcomes: dict = {}
    for i, request in enumerate(streams + [bad]):
        request.on_finish = lambda o, i=i: outcomes.__setitem__(i, o)
    scheduler.submit_all(streams)
    scheduler.step()
    scheduler.step()
    scheduler.submit(bad)
    # A seed that slipped past submit's check (it refuses this one): torch.Generator.manual_seed
    # raises while the row is built. That must end this request, not the step.
    bad.sampling = SamplingParams(temperature=1.0, seed=2**64)
    scheduler.run_until_idle()
    assert outcomes[8].finish_reason == "error" and "setting up the request failed" in outcomes[8].error
    for i, request in enumerate(streams):
        assert outcomes[i].finish_reason == "length"
        assert outcomes[i].token_ids == alone(engine, list(request.prompt), 12)


def test_a_failed_step_ends_the_requests_it_had_taken_off_the_queue(engine):
    """abort_all ends every request it owns, including those admitted but not yet running."""
    scheduler = Scheduler(engine.decoder, max_batch=4)
    outcomes: list = []
    both = threading.Event()

    def broken_client(token):
        raise RuntimeError("a client callback failed")

    def done(outcome):
        outcomes.append(outcome)
        if len(outcomes) == 2:
            both.set()

    first = Request(prompt=PROMPT, max_new_tokens=3, on_token=broken_client, on_finish=done)
    second = Request(prompt=OTHER, max_new_tokens=3, on_finish=done)
    scheduler.submit_all([first, second])  # one prefill; the first's token raises before the second runs
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)
    thread.start()
    try:
        both.wait(60)  # without abort_all knowing the second, it would never end
    finally:
        stop.set()
        thread.join(60)
    assert sorted(o.finish_reason for o in outcomes) == ["error", "error"]
    assert all("a client callback failed" in o.error for o in outcomes)


def test_seeds_beyond_64_bits_are_refused_at_submit(engine):
    from moekit.errors import MoekitError

    scheduler = Scheduler(engine.decoder, max_batch=2)
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(MoekitError, match="seed must be between"):
            scheduler.submit(Request(prompt=PROMPT, max_new_tokens=2, sampling=SamplingParams(temperature=1.0, seed=seed)))
    for seed in (2**64 - 1, -(2**63)):
        assert generate_batch(scheduler, [Request(prompt=PROMPT, max_new_tokens=2, sampling=SamplingParams(temperature=1.0, seed=seed))])[0].finish_reason == "length"
