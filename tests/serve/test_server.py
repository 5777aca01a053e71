"""`moekit serve` on the bundled model, driven by the official OpenAI client and by raw HTTP.

The expected texts come from the engine in this process (`moekit.load` + generate, fp32 greedy):
what `moekit run` gives each prompt alone.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moekit.engine.default_model import bundled_model_path
from moekit.serve.chat import PLAIN_TEMPLATE, load_chat_template

# A server process answers these tests; tests/conftest.py keeps such tests from overlapping.
pytestmark = pytest.mark.processes

openai = pytest.importorskip("openai")

PROMPTS = [
    "def parse_args(argv):",
    "import os\n",
    "NAME\n    ls - list",
    "for i in range(",
    "The quick brown fox",
    "#!/bin/sh\n",
    "class Stack:",
    "SYNOPSIS\n",
]
TIMEOUT = httpx.Timeout(120.0)


def solo(engine, prompt, new: int, ignore_eos: bool = True) -> list[int]:
    ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return engine.generate([ids], max_new_tokens=new, stop_ids=() if ignore_eos else None).token_ids[0]


def test_health_and_models(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.v1 + "/models").json()
    assert [m["id"] for m in models["data"]] == ["moekit-demo"]
    assert models["data"][0]["max_model_len"] == 1024


def test_a_completion_through_the_openai_client_is_what_moekit_run_writes(client, engine):
    out = client.completions.create(model="moekit-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    want = solo(engine, PROMPTS[0], 24, ignore_eos=False)
    assert out.choices[0].text == engine.decode(want)
    assert out.usage.prompt_tokens == len(engine.encode(PROMPTS[0]))
    assert out.usage.completion_tokens == len(want)
    moe = out.usage.model_extra["moe"]
    assert moe["tier"] == "S" and moe["top_k"] == 2
    assert moe["active_share"] == pytest.approx(0.0935, abs=5e-4)  # 1.82M of 19.43M per token
    assert 0 < moe["experts_touched"] <= 4 * 128


def test_chat_renders_the_plain_template_when_the_model_has_none(client, engine):
    messages = [{"role": "system", "content": "You write shell."}, {"role": "user", "content": "list files"}]
    out = client.chat.completions.create(model="moekit-demo", messages=messages, max_tokens=12, temperature=0)
    template = load_chat_template(bundled_model_path())
    assert template.source == PLAIN_TEMPLATE
    text = template.render(messages)
    assert text == "system: You write shell.\nuser: list files\nassistant:"
    ids = list(engine.tokenizer.encode(text, add_special_tokens=False).ids)
    want = engine.generate([ids], max_new_tokens=12).token_ids[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == engine.decode(want)


def test_streaming_gives_the_same_text_and_a_final_usage_chunk(client):
    whole = client.completions.create(model="moekit-demo", prompt=PROMPTS[3], max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model="moekit-demo", prompt=PROMPTS[3], max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.model_extra["moe"]["top_k"] == 2


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats, which GuideLLM sends with every streamed request."""
    body = {"prompt": PROMPTS[3], "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        objects = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [o["usage"]["completion_tokens"] for o in objects if o["choices"]]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) >= 6
    assert objects[-1]["choices"] == [] and objects[-1]["usage"]["completion_tokens"] == 6


def test_chat_streaming_starts_with_the_role_and_ends_with_done(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=TIMEOUT) as r:
        frames = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    objects = [json.loads(f) for f in frames[:-1]]
    assert objects[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(o["object"] == "chat.completion.chunk" for o in objects)
    assert objects[-1]["choices"][0]["finish_reason"] == "length"


def test_token_id_prompts_and_returned_token_ids(server, engine):
    ids = engine.encode(PROMPTS[6])
    r = httpx.post(
        server.v1 + "/completions",
        json={"prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == solo(engine, ids, 10)
    assert choice["text"] == engine.decode(choice["token_ids"])


def test_tier_b_uses_one_expert_and_a_lower_share_than_tier_s(server, engine):
    def moe(extra):
        body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}
        r = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()["usage"]["moe"]

    s_ids, s = moe({"moe": {"tier": "S"}})
    b_ids, b = moe({"moe": {"tier": "B"}})
    k1_ids, k1 = moe({"moe": {"top_k": 1}})
    assert (s["tier"], s["top_k"], b["tier"], b["top_k"]) == ("S", 2, "B", 1)
    assert b["active_share"] < s["active_share"]
    assert b["bytes_read_per_token"] < s["bytes_read_per_token"]
    assert s_ids == solo(engine, PROMPTS[1], 12)
    assert b_ids == k1_ids and b["active_share"] == k1["active_share"]


def test_sixteen_concurrent_clients_get_their_solo_tokens(server, engine):
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + 3 * i) for i in range(16)]  # 16 lengths: rows leave at different steps

    def ask(job):
        prompt, new = job
        body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        return httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, jobs))
    for (prompt, new), ids in zip(jobs, got):
        assert ids == solo(engine, prompt, new), prompt


def test_a_stop_string_cuts_the_text_and_ends_the_request(client, engine):
    whole = client.completions.create(model="moekit-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0).choices[0].text
    stop = whole.strip().split()[1]  # a word from the middle of the greedy text
    cut = client.completions.create(model="moekit-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[: whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="moekit-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole[: whole.index(stop)]


def test_seeded_sampling_repeats(client):
    kwargs = dict(model="moekit-demo", prompt=PROMPTS[4], max_tokens=16, temperature=0.8, top_p=0.95, seed=3)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def _metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _total(metrics: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))


def test_metrics_count_what_was_served(server):
    before = _metrics(server)
    bodies = [{"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True} for p in PROMPTS[:3]]
    bodies.append({"prompt": PROMPTS[3], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "moe": {"tier": "B"}})
    usages = [httpx.post(server.v1 + "/completions", json=b, timeout=TIMEOUT).json()["usage"] for b in bodies]
    after = _metrics(server)

    def delta(name, **labels):
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert delta("moekit:request_success_total", finished_reason="length") == 4
    assert delta("moekit:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 19
    assert delta("moekit:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("moekit:e2e_request_latency_seconds_count", tier="S") == 3
    assert delta("moekit:e2e_request_latency_seconds_count", tier="B") == 1
    assert delta("moekit:time_to_first_token_seconds_count") == 4
    assert delta("moekit:inter_token_latency_seconds_count") == 19 - 4
    assert delta("moekit:active_share_per_token_count") == 19
    routed = sum(u["prompt_tokens"] + u["completion_tokens"] - 1 for u in usages[:3]) * 2 + (
        usages[3]["prompt_tokens"] + usages[3]["completion_tokens"] - 1
    )
    assert delta("moekit:expert_tokens_total") == routed * 4  # 4 MoE layers, K per token
    assert _total(after, "moekit:num_requests_running") == 0
    assert set(_total(after, "moekit:expert_load_imbalance", layer=str(l)) > 1 for l in range(4)) == {True}


def test_first_token_stages_split_the_wait_a_client_sees(server):
    """Parse, queue, prefill and stream: each request's stages on /metrics, and a streamed
    request's stages together within the time its client waited for the first token."""
    before = _metrics(server)
    body = {"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # the first token's frame
        waited = time.perf_counter() - sent
        assert "data: [DONE]" in list(lines)  # read to the end: the request has finished
    middle = _metrics(server)
    httpx.post(server.v1 + "/completions", json={**body, "stream": False}, timeout=TIMEOUT).raise_for_status()
    after = _metrics(server)

    def delta(upto, since, name, **labels):
        return _total(upto, name, **labels) - _total(since, name, **labels)

    stages = ("parse", "queue", "prefill", "stream")
    streamed = [delta(middle, before, "moekit:first_token_stage_seconds_sum", stage=s) for s in stages]
    assert [delta(middle, before, "moekit:first_token_stage_seconds_count", stage=s) for s in stages] == [1, 1, 1, 1]
    assert 0 < sum(streamed) <= waited
    # A whole reply has no first frame: its stages stop at the first token.
    assert [delta(after, middle, "moekit:first_token_stage_seconds_count", stage=s) for s in stages] == [1, 1, 1, 0]


def test_a_dropped_stream_frees_its_slot(server):
    body = {"prompt": PROMPTS[2], "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        assert _total(_metrics(server), "moekit:num_requests_running") == 1
    import time

    deadline = time.monotonic() + 20
    while _total(_metrics(server), "moekit:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the dropped stream's row is still running"
        time.sleep(0.05)
    assert _total(_metrics(server), "moekit:request_success_total", finished_reason="abort") >= 1


BAD = [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    (b'{"max_tokens": 4}', 400, "prompt", "prompt: is required"),
    (b'{"prompt": 5}', 400, "prompt", "string or a list of token ids"),
    (b'{"prompt": "hi", "max_tokens": "4"}', 400, "max_tokens", "must be an integer"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens", "at least 1"),
    (b'{"prompt": "hi", "max_tokens": 5000}', 400, "max_tokens", "exceed the context"),
    (b'{"prompt": [1, 2, 99999], "max_tokens": 4}', 400, "prompt", "outside the vocabulary"),
    (b'{"prompt": [], "max_tokens": 4}', 400, "prompt", "empty"),
    (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model", "does not exist"),
    (b'{"prompt": "hi", "moe": {"tier": "Z"}}', 400, "moe.tier", "'S', 'A' or 'B'"),
    (b'{"prompt": "hi", "moe": {"top_k": 3}}', 400, "moe.top_k", "between 1 and the model's 2"),
    (b'{"prompt": "hi", "moe": {"top_k": 0}}', 400, "moe.top_k", "greater than or equal to 1"),
    (b'{"prompt": "hi", "moe": {"topk": 1}}', 400, "moe.topk", "unknown field"),
    (b'{"prompt": "hi", "temperature": -1}', 400, "temperature", "greater than or equal to 0"),
    (b'{"prompt": "hi", "top_p": 0}', 400, "top_p", "greater than 0"),
    (b'{"prompt": "hi", "top_k": -5}', 400, "top_k", "greater than or equal to -1"),
    (b'{"prompt": "hi", "n": 0}', 400, "n", "greater than or equal to 1"),
    (b'{"prompt": "hi", "stop": [""]}', 400, "stop", "must not be empty"),
]


@pytest.mark.parametrize("raw, status, param, message", BAD)
def test_bad_requests_get_openai_errors(server, raw, status, param, message):
    r = httpx.post(server.v1 + "/completions", content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert message in error["message"]


def test_a_prompt_longer_than_the_context_and_an_oversized_body(server):
    r = httpx.post(server.v1 + "/completions", json={"prompt": [5] * 1024, "max_tokens": 1}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(server.v1 + "/completions", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}', timeout=TIMEOUT)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(server.v1 + "/chat/completions", json={"messages": []}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.get(server.v1 + "/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_unimplemented_fields_are_accepted_only_when_they_ask_for_nothing(server):
    body = {"prompt": "hi", "max_tokens": 2, "presence_penalty": 0, "user": "me", "logit_bias": {}, "best_of": 1, "echo": False}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    for field, value in [("presence_penalty", 0.5), ("logit_bias", {"5": 10}), ("best_of", 3), ("suffix", "x"), ("nonsense", 1)]:
        r = httpx.post(server.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2, field: value}, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    # response_format and tools are implemented (tests/serve/test_structured.py); the legacy function fields are not.
    for field, value in [("functions", [{"name": "f"}]), ("function_call", "auto")]:
        r = httpx.post(server.v1 + "/chat/completions", json={**chat, field: value}, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="moekit-demo", prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
