"""Continuous batching is exact: every request gets, token for token, what it gets alone.

Requests of different prompt and output lengths join a running batch at different steps, leave
it at different steps, and rows of one batch use different K. The oracles: moekit's own lone
`generate` (itself held to transformers' generate in test_generate_vs_transformers.py) and, for
a reduced K, transformers' generate with `num_experts_per_tok` set to that K.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_tiny import DENSE_FAMILIES, MOE_FAMILIES
from moekit.engine.loader import load_engine
from moekit.engine.sampling import SamplingParams
from moekit.engine.scheduler import QueueFull, Request, Scheduler, generate_batch, tier_top_k
from moekit.errors import MoekitError

PROMPTS = [
    [1, 17, 42, 99, 5, 63, 120],
    [3, 4],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
    [150, 2, 77],
    [5],
    [60, 61, 62, 63, 64, 65],
]
NEW = [10, 4, 14, 7, 12, 5]


def alone(engine, prompt, new, sampling=SamplingParams()):
    return engine.generate([prompt], max_new_tokens=new, sampling=sampling, stop_ids=()).token_ids[0]


def run_staggered(scheduler: Scheduler, requests: list[Request], first: int, steps_between: int):
    """Submit `first` requests, step a few times, then the rest one per step: rows join mid-run."""
    outcomes: dict[int, object] = {}
    for i, request in enumerate(requests):
        request.on_finish = lambda outcome, i=i: outcomes.__setitem__(i, outcome)
    for request in requests[:first]:
        scheduler.submit(request)
    for _ in range(steps_between):
        scheduler.step()
    for request in requests[first:]:
        scheduler.submit(request)
        scheduler.step()
    scheduler.run_until_idle()
    return [outcomes[i] for i in range(len(requests))]


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_every_request_gets_its_lone_tokens_when_rows_join_and_leave(family, tiny_checkpoints):
    engine = load_engine(tiny_checkpoints(family), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=4)  # 6 requests, 4 rows: two wait for a free row
    requests = [Request(prompt=p, max_new_tokens=n) for p, n in zip(PROMPTS, NEW)]
    outcomes = run_staggered(scheduler, requests, first=3, steps_between=2)
    for prompt, new, outcome in zip(PROMPTS, NEW, outcomes):
        assert outcome.finish_reason == "length"
        assert outcome.token_ids == alone(engine, prompt, new), f"{family}: prompt {prompt}"
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0


def test_a_stop_token_ends_only_its_row(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    lone = alone(engine, PROMPTS[0], 10)
    stop = lone[3]  # the row's own 4th token: it must stop there, token included
    scheduler = Scheduler(engine.decoder, max_batch=4)
    outcomes = generate_batch(
        scheduler,
        [Request(prompt=PROMPTS[0], max_new_tokens=10, stop_ids=(stop,)), Request(prompt=PROMPTS[2], max_new_tokens=10)],
    )
    assert outcomes[0].finish_reason == "stop"
    assert outcomes[0].token_ids == lone[: lone.index(stop) + 1]
    assert outcomes[1].token_ids == alone(engine, PROMPTS[2], 10)


def test_seeded_sampling_per_row_equals_the_lone_seeded_run(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    scheduler = Scheduler(engine.decoder, max_batch=4)
    outcomes = generate_batch(
        scheduler,
        [Request(prompt=PROMPTS[0], max_new_tokens=12, sampling=sampled), Request(prompt=PROMPTS[1], max_new_tokens=12)],
    )
    assert outcomes[0].token_ids == alone(engine, PROMPTS[0], 12, sampled)
    assert outcomes[1].token_ids == alone(engine, PROMPTS[1], 12)


def _transformers_greedy(folder, prompt, new, **config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", **config)
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _one_expert_oracle(family, folder, tmp_path):
    """prompt → 8 greedy tokens with K = 1: transformers with num_experts_per_tok=1, except for
    phimoe, whose reference sparsemixer makes two passes whatever K says, and dbrx, whose K lives
    in ffn_config; there the oracle is moekit alone on the same weights with K = 1 in config.json."""
    if family not in ("phimoe", "dbrx"):
        return lambda prompt: _transformers_greedy(folder, prompt, 8, num_experts_per_tok=1)
    copy = tmp_path / "k1"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    if family == "dbrx":
        config["ffn_config"]["moe_top_k"] = 1
    else:
        config["num_experts_per_tok"] = 1
    (copy / "config.json").write_text(json.dumps(config))
    engine = load_engine(copy, compile=False)
    return lambda prompt: alone(engine, prompt, 8)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_row_with_fewer_experts_routes_as_the_family_does_with_that_k(family, tiny_checkpoints, tmp_path):
    """Tier B (one expert) beside tier S rows: the family routed with K = 1 is the oracle."""
    folder = tiny_checkpoints(family)
    engine = load_engine(folder, compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=4)
    requests = [
        Request(prompt=PROMPTS[0], max_new_tokens=8, tier="B"),
        Request(prompt=PROMPTS[2], max_new_tokens=8, tier="S"),
        Request(prompt=PROMPTS[5], max_new_tokens=8, top_k=1),
    ]
    outcomes = generate_batch(scheduler, requests)
    one = _one_expert_oracle(family, folder, tmp_path)
    one_expert = one(PROMPTS[0])
    assert outcomes[0].token_ids == one_expert
    if family in ("mixtral", "granitemoe", "gpt_oss", "deepseek_v3", "phimoe"):
        # There one expert changes the greedy text, so a row that ignored its K would fail here
        # (the qwen, olmoe and dbrx tiny models happen to write the same 8 tokens with K = 1).
        assert one_expert != alone(engine, PROMPTS[0], 8)
    assert outcomes[2].token_ids == one(PROMPTS[5])
    assert outcomes[1].token_ids == alone(engine, PROMPTS[2], 8)
    assert outcomes[0].usage.top_k == 1 and outcomes[1].usage.top_k == 2
    assert outcomes[0].usage.active_share < outcomes[1].usage.active_share


def test_usage_meters_the_rows_own_experts(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    gen = engine.generate([PROMPTS[0]], max_new_tokens=6, stop_ids=())
    metered = engine.meter(gen)
    scheduler = Scheduler(engine.decoder, max_batch=2)
    outcome = generate_batch(scheduler, [Request(prompt=PROMPTS[0], max_new_tokens=6), Request(prompt=PROMPTS[3], max_new_tokens=3)])[0]
    usage = outcome.usage
    assert usage.generated_tokens == 6
    assert usage.active_params_per_token == pytest.approx(sum(t.active_params for t in metered) / 6)
    assert usage.bytes_read_per_token == pytest.approx(sum(t.bytes_touched for t in metered) / 6)
    assert usage.experts_touched == metered[-1].distinct_experts_total
    # Prometheus' expert load: every routed (token, expert) pair of both requests, prompts included.
    counted = sum(sum(v) for v in scheduler.expert_tokens.values())
    layers = len(scheduler.moe_layers)
    tokens = (len(PROMPTS[0]) + 5) + (len(PROMPTS[3]) + 2)  # prompt passes + decode passes
    assert counted == tokens * layers * 2


def test_a_request_that_ends_at_its_first_token_is_metered_with_its_prompt(tiny_checkpoints):
    """A prompt's metering waits until its first token is on its way (Scheduler._meter_held): a row
    that ends at that token, or that only scores its prompt, is metered all the same."""
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    metered = engine.meter(engine.generate([PROMPTS[0]], max_new_tokens=1, stop_ids=()))
    scheduler = Scheduler(engine.decoder, max_batch=2)
    layers = len(scheduler.moe_layers)
    outcome = generate_batch(scheduler, [Request(prompt=PROMPTS[0], max_new_tokens=1)])[0]
    usage = outcome.usage
    assert outcome.token_ids == [engine.generate([PROMPTS[0]], max_new_tokens=1, stop_ids=()).token_ids[0][0]]
    assert usage.active_params_per_token == pytest.approx(metered[0].active_params)
    assert usage.experts_touched == metered[-1].distinct_experts_total > 0
    assert sum(sum(v) for v in scheduler.expert_tokens.values()) == len(PROMPTS[0]) * layers * 2
    # A row that only scores its prompt finishes as it is placed, before the step meters held prompts.
    scored: list = []
    [only] = generate_batch(scheduler, [Request(prompt=PROMPTS[0], max_new_tokens=0, prompt_logprobs=1,
                                                on_prompt_logprobs=scored.append)])
    assert len(scored[0]) == len(PROMPTS[0]) and only.token_ids == []
    assert only.usage.experts_touched == usage.experts_touched
    assert sum(sum(v) for v in scheduler.expert_tokens.values()) == 2 * len(PROMPTS[0]) * layers * 2


def test_a_request_is_metered_alike_by_a_scheduler_that_metered_other_ks_before(tiny_checkpoints):
    """The scheduler keeps a generated token's cost per count of experts each layer used
    (Scheduler._token_cost): what tiers and a policy that narrows some tokens (top1 beside K = 2,
    and adaptive, whose layers use different counts) left there must not change a later request's
    usage, which is what a fresh scheduler meters for it."""
    from moekit.model.routing import parse_policy

    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    used = Scheduler(engine.decoder, max_batch=3)
    generate_batch(used, [Request(prompt=PROMPTS[2], max_new_tokens=6, tier="B"),
                          Request(prompt=PROMPTS[1], max_new_tokens=6, routing=parse_policy("adaptive:0.6", 2)),
                          Request(prompt=PROMPTS[3], max_new_tokens=6, routing=parse_policy("top1", 2))])
    assert used._token_costs  # filled
    for request in (lambda: Request(prompt=PROMPTS[0], max_new_tokens=6),
                    lambda: Request(prompt=PROMPTS[0], max_new_tokens=6, tier="A"),
                    lambda: Request(prompt=PROMPTS[5], max_new_tokens=6, routing=parse_policy("adaptive:0.6", 2))):
        fresh = Scheduler(engine.decoder, max_batch=3)
        assert generate_batch(used, [request()])[0].usage == generate_batch(fresh, [request()])[0].usage


def test_a_cancelled_request_leaves_and_frees_its_row(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("olmoe"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=1)
    seen: list[int] = []
    outcomes: list = []
    first = Request(prompt=PROMPTS[0], max_new_tokens=50, on_token=seen.append, on_finish=outcomes.append)
    second = Request(prompt=PROMPTS[1], max_new_tokens=5, on_finish=outcomes.append)
    scheduler.submit(first)
    scheduler.submit(second)
    for _ in range(3):
        scheduler.step()
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1
    scheduler.cancel(first)
    scheduler.step()  # the cancelled row leaves; the waiting one takes its row in the same step
    assert outcomes[0].finish_reason == "cancelled" and len(outcomes[0].token_ids) == len(seen) < 50
    scheduler.run_until_idle()
    assert outcomes[1].token_ids == alone(engine, PROMPTS[1], 5)


def test_tiers_are_admitted_s_before_a_before_b_and_queues_are_bounded(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=1, queue_limit=2)
    order: list[str] = []
    for tier in ("B", "A", "S", "B"):
        scheduler.submit(Request(prompt=[5, 6], max_new_tokens=1, tier=tier, on_finish=lambda o: order.append(o.usage.tier)))
    with pytest.raises(QueueFull, match="tier B queue is full"):
        scheduler.submit(Request(prompt=[5, 6], max_new_tokens=1, tier="B"))
    scheduler.run_until_idle()
    assert order == ["S", "A", "B", "B"]


def test_tier_k_and_bad_requests():
    assert [tier_top_k(t, 8) for t in "SAB"] == [8, 4, 1]
    assert [tier_top_k(t, 3) for t in "SAB"] == [3, 2, 1]
    with pytest.raises(MoekitError, match="tier must be one of S, A, B"):
        tier_top_k("C", 2)


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        (dict(prompt=[1, 2], max_new_tokens=0), "max-new-tokens must be at least 1"),
        (dict(prompt=[1, 999], max_new_tokens=2), "outside the vocabulary"),
        (dict(prompt=[1] * 250, max_new_tokens=10), "exceeds the model's context"),
        (dict(prompt=[1, 2], max_new_tokens=2, top_k=3), "top_k must be between 1 and the model's 2"),
        (dict(prompt=[1, 2], max_new_tokens=2, tier="Z"), "tier must be one of"),
        (dict(prompt=[1, 2], max_new_tokens=2, sampling=SamplingParams(top_p=1.5)), "top-p must be in"),
    ],
)
def test_submit_refuses_what_cannot_run(request_kwargs, message, tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=2)
    with pytest.raises(MoekitError, match=message):
        scheduler.submit(Request(**request_kwargs))
    assert scheduler.num_waiting == 0


def test_a_burst_is_prefilled_together_within_the_prefill_budget(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("gpt_oss"), compile=False)
    steps: list = []
    # 12 padded tokens per step at most. Prompt lengths 7, 2, 3, 1: the 7 goes alone (with the 2
    # it would pad to 2 × 7 = 14); the next step takes the 2, the 3 and the 1 together (3 × 3 = 9).
    scheduler = Scheduler(engine.decoder, max_batch=4, prefill_tokens=12, on_step=steps.append)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[4]]
    outcomes = generate_batch(scheduler, [Request(prompt=p, max_new_tokens=6) for p in prompts])
    assert [s.admitted for s in steps[:2]] == [1, 3]
    for prompt, outcome in zip(prompts, outcomes):
        assert outcome.token_ids == alone(engine, prompt, 6)


def test_requests_that_arrive_during_a_prefill_join_that_steps_decode_within_the_budget(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    steps: list = []
    scheduler = Scheduler(engine.decoder, max_batch=4, prefill_tokens=12, on_step=steps.append)
    first = Request(prompt=PROMPTS[0], max_new_tokens=5)  # 7 prompt tokens: 5 of the step's 12 are left
    late = [Request(prompt=PROMPTS[1], max_new_tokens=5), Request(prompt=PROMPTS[2], max_new_tokens=5)]  # 2 and 12 tokens
    arriving = list(late)
    # The first token is sampled right after the prefill, on the scheduler's thread, before the
    # step decodes: the others arrive then, as a burst's late part does.
    first.on_token = lambda token: scheduler.submit_all([arriving.pop() for _ in range(len(arriving))][::-1])
    requests = [first, *late]
    outcomes: dict[int, object] = {}
    for i, request in enumerate(requests):
        request.on_finish = lambda outcome, i=i: outcomes.__setitem__(i, outcome)
    scheduler.submit(first)
    scheduler.run_until_idle()
    # The 2-token prompt fits what is left and decodes in the first step beside the first; the
    # 12-token one does not, and waits for the next step.
    assert [(s.admitted, s.batch) for s in steps[:2]] == [(2, 2), (1, 3)]
    assert len(outcomes[0].token_ids) == len(outcomes[1].token_ids)
    for i, request in enumerate(requests):
        assert outcomes[i].token_ids == alone(engine, list(request.prompt), 5)


def test_with_rows_running_an_arrival_during_a_prefill_waits_for_the_next_step(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    steps: list = []
    scheduler = Scheduler(engine.decoder, max_batch=4, on_step=steps.append)
    running = Request(prompt=PROMPTS[3], max_new_tokens=6)
    first = Request(prompt=PROMPTS[0], max_new_tokens=4)
    late = Request(prompt=PROMPTS[1], max_new_tokens=4)
    first.on_token = lambda token: None if late.submitted_at else scheduler.submit(late)
    requests = [running, first, late]
    outcomes: dict[int, object] = {}
    for i, request in enumerate(requests):
        request.on_finish = lambda outcome, i=i: outcomes.__setitem__(i, outcome)
    scheduler.submit(running)
    scheduler.step()
    scheduler.submit(first)
    scheduler.run_until_idle()
    # A second prefill would hold up the running row's decode: the late request starts a step later.
    assert [(s.admitted, s.batch) for s in steps[:3]] == [(1, 1), (1, 2), (1, 3)]
    for i, request in enumerate(requests):
        assert outcomes[i].token_ids == alone(engine, list(request.prompt), request.max_new_tokens)


def test_the_decode_after_a_first_token_waits_until_its_client_has_passed_it_on(tiny_checkpoints):
    """A server's event loop writes a first token's frame before the next decode step starts
    (Request.first_passed, Scheduler first_token_wait_s); the tokens stay the lone ones."""
    import threading

    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    seen: list = []
    passed = threading.Event()

    def pass_on_later() -> None:  # the event loop, writing the frame while the engine thread waits
        threading.Event().wait(0.05)
        seen.append("passed")
        passed.set()

    def on_token(token: int) -> None:
        seen.append(token)
        if len(seen) == 1:
            threading.Thread(target=pass_on_later).start()

    scheduler = Scheduler(engine.decoder, max_batch=2, first_token_wait_s=60.0)
    request = Request(prompt=PROMPTS[0], max_new_tokens=3, on_token=on_token, first_passed=passed)
    [outcome] = generate_batch(scheduler, [request])
    lone = alone(engine, PROMPTS[0], 3)
    assert seen == [lone[0], "passed", *lone[1:]]
    assert outcome.token_ids == lone


def test_a_first_token_nobody_passes_on_holds_the_decode_only_for_the_wait(tiny_checkpoints):
    import threading

    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=2, first_token_wait_s=0.01)
    requests = [Request(prompt=p, max_new_tokens=4, first_passed=threading.Event()) for p in PROMPTS[:2]]
    outcomes = generate_batch(scheduler, requests)
    for prompt, outcome in zip(PROMPTS[:2], outcomes):
        assert outcome.token_ids == alone(engine, prompt, 4)
