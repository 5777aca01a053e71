"""A real `moekit serve` with per-request routing and SLA tiers, driven by the OpenAI client.

Oracles: the engine in this process — a free greedy request gets its lone tokens, a request with
"moe": {"routing": P} what `generate(..., policy=P)` (the path of `moekit run --routing P`) gives.
Admission: with a TTFT target no step can meet (0.01 ms), a request once a step has been measured
is demoted (to a tier without a target) or refused (429) as configured.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_process import start_server
from moekit.engine.default_model import bundled_model_path
from moekit.engine.loader import load_engine
from moekit.model.routing import parse_policy

openai = pytest.importorskip("openai")

PROMPTS = ["def parse_args(argv):", "NAME\n    ls - list", "The quick brown fox", "class Stack:"]
ROUTING = [None, "adaptive:0.85", None, "ema:0.9"]
NEW = 16


@pytest.fixture(scope="module")
def engine():
    return load_engine(bundled_model_path(), compile=False)


def lone(engine, prompt, policy=None):
    return engine.generate([engine.encode(prompt)], max_new_tokens=NEW, stop_ids=(),
                           policy=None if policy is None else parse_policy(policy, 2)).token_ids[0]


def complete(url, prompt, moe=None):
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if moe is not None:
        body["moe"] = moe
    return httpx.post(url + "/v1/completions", json=body, timeout=120.0)


def test_rows_of_different_policies_in_one_batch_each_get_their_own_tokens(serve_process, engine):
    server = serve_process("--eager", "--max-batch", "4", "--tier", "A=adaptive:0.6")
    moes = [None if r is None else {"routing": r} for r in ROUTING]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda pm: complete(server.url, *pm), zip(PROMPTS, moes)))
    for prompt, policy, reply in zip(PROMPTS, ROUTING, replies):
        assert reply.status_code == 200, reply.text
        choice, moe = reply.json()["choices"][0], reply.json()["usage"]["moe"]
        assert choice["token_ids"] == lone(engine, prompt, policy), policy
        assert moe.get("routing") == policy
        assert moe["expert_flops"] > 0 and moe["flops"] > moe["expert_flops"] and moe["expert_bytes"] > 0

    tiered = complete(server.url, PROMPTS[0], {"tier": "A"}).json()  # the tier's policy, set by the operator
    assert tiered["usage"]["moe"]["routing"] == "adaptive:0.6"
    assert tiered["choices"][0]["token_ids"] == lone(engine, PROMPTS[0], "adaptive:0.6")

    metrics = httpx.get(server.url + "/metrics").text  # router health: entropy by layer and position, jitter
    assert 'moekit:routing_entropy{layer="0",position="0"}' in metrics
    assert 'moekit:itl_jitter_index_count{tier="S"}' in metrics

    client = openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120.0, max_retries=0)
    for bad in ("adaptive:2x", "topk:129", "nonsense"):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="moekit-demo", prompt="x", max_tokens=2, extra_body={"moe": {"routing": bad}})
        assert err.value.body["param"] == "moe.routing" and bad in err.value.body["message"]


def test_a_tiers_ttft_target_demotes_or_refuses_and_metrics_give_goodput(serve_process):
    server = serve_process("--eager", "--tier", "S=ttft:0.01ms,itl:10s", "--tier", "B=ttft:0.01ms", "--sla-action", "demote")
    first = complete(server.url, PROMPTS[0])  # nothing measured yet: admitted in S, and too slow for it
    assert first.status_code == 200 and first.json()["usage"]["moe"]["tier"] == "S"
    demoted = complete(server.url, PROMPTS[1])  # S cannot start in 0.01 ms; A has no target
    assert demoted.status_code == 200 and demoted.json()["usage"]["moe"]["tier"] == "A"
    refused = complete(server.url, PROMPTS[2], {"tier": "B"})  # B is the last tier: nowhere to go
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "tier B" in error["message"]
    metrics = httpx.get(server.url + "/metrics").text
    for line in ('moekit:tier_requests_finished_total{tier="S"} 1.0', 'moekit:tier_requests_met_slo_total{tier="S"} 0.0',
                 'moekit:tier_slo_attainment{tier="A"} 1.0', 'moekit:tier_requests_rejected_total{tier="B"} 1.0',
                 'moekit:tier_requests_demoted_total{from_tier="S",to_tier="A"} 1.0',
                 'moekit:tier_target_seconds{target="ttft",tier="S"} 1e-05'):
        assert line in metrics, line


def test_bad_tier_options_exit_2_with_one_line(tmp_path):
    import subprocess
    import sys

    for args, needle in ((["--tier", "S=ttft:fast"], "not a duration"), (["--tier", "A=topk:129"], "k must be"),
                         (["--sla-action", "drop"], "--sla-action")):
        proc = subprocess.run([sys.executable, "-m", "moekit", "serve", "--port", "0", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr and "Traceback" not in proc.stderr
