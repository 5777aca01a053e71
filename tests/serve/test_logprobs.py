"""Logprobs as clients read them, on the bundled model over HTTP: completions' legacy object with
echo (the prompt's tokens first, the first one null), chat's `logprobs.content`, streamed and not,
against log_softmax of moekit's own forward in this process."""

from __future__ import annotations

import json

import httpx
import pytest
import torch


openai = pytest.importorskip("openai")

TIMEOUT = httpx.Timeout(120.0)
PROMPT = "def parse_args(argv):"


def forward_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of moekit's forward over ids: [T, V], row t scores ids[t + 1]."""
    with torch.inference_mode():
        cache = engine.decoder.new_cache(1, len(ids))
        logits = engine.decoder(torch.tensor([ids]), cache, torch.arange(len(ids))[None])
    return torch.log_softmax(logits[0].float(), dim=-1)


def completion(server, **fields) -> dict:
    body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **fields}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_echo_scores_the_prompt_and_the_completion_as_the_model_does(server, engine):
    choice = completion(server, max_tokens=4, logprobs=3, echo=True)
    prompt = engine.encode(PROMPT)
    ids = prompt + choice["token_ids"]
    reference = forward_logprobs(engine, ids[:-1])  # [T-1, V]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and choice["text"].startswith(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(float(reference[t - 1, ids[t]]), abs=1e-4)
        top = sorted(lp["top_logprobs"][t].values(), reverse=True)[:3]
        assert top == pytest.approx(reference[t - 1].topk(3).values.tolist(), abs=1e-4)
    for t in range(len(prompt), len(ids)):  # greedy: each generated token is the most likely one
        assert lp["token_logprobs"][t] == pytest.approx(max(lp["top_logprobs"][t].values()))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_the_official_client_scores_a_prompt_as_lm_eval_asks(client, engine, max_tokens):
    out = client.completions.create(model="moekit-demo", prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    prompt = engine.encode(PROMPT)
    assert len(lp.token_logprobs) == len(prompt) + max_tokens and lp.token_logprobs[0] is None
    reference = forward_logprobs(engine, prompt)
    expected = [float(reference[t - 1, prompt[t]]) for t in range(1, len(prompt))]
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
    assert out.choices[0].text.startswith(PROMPT)


def test_streamed_logprobs_are_the_whole_ones(server):
    whole = completion(server, max_tokens=5, logprobs=2)
    body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "max_tokens": 5, "logprobs": 2, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [lp for f in frames for lp in (f["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-6)
    assert "".join(f["choices"][0]["text"] for f in frames) == whole["text"]


def test_chat_logprobs_in_openais_shape_streamed_and_not(client, engine):
    messages = [{"role": "user", "content": "Write a shell loop."}]
    out = client.chat.completions.create(model="moekit-demo", messages=messages, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content) == out.choices[0].message.content
    stream = client.chat.completions.create(model="moekit-demo", messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    streamed = [e.logprob for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-6)
    r = httpx.post(client.base_url.join("chat/completions").__str__(),
                   json={"messages": messages, "top_logprobs": 2}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
