"""Several prompts in one completions request, and `n` continuations of one prompt: one indexed
choice each, each what `moekit run` gives it alone (greedy, or seeded with seed + i)."""

from __future__ import annotations

import json

import httpx
import pytest

from moekit.engine.sampling import SamplingParams

openai = pytest.importorskip("openai")

TIMEOUT = httpx.Timeout(120.0)


def solo(engine, ids, new, sampling=SamplingParams()):
    return engine.generate([ids], max_new_tokens=new, sampling=sampling, stop_ids=()).token_ids[0]


def test_a_list_of_prompts_gets_one_indexed_choice_each(server, engine):
    prompts = ["import os\n", "for x in", "class Stack:"]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    ids = [engine.encode(p) if isinstance(p, str) else p for p in prompts]
    for choice, prompt in zip(out["choices"], ids):
        assert choice["token_ids"] == solo(engine, prompt, 6)
        assert choice["text"] == engine.decode(choice["token_ids"])
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids)) and out["usage"]["completion_tokens"] == 18


def test_the_official_client_sends_token_id_batches(server, engine):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120.0, max_retries=0)
    prompts = [[5, 6, 7], [100, 200]]
    out = client.completions.create(model="moekit-demo", prompt=prompts, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        assert choice.model_extra["token_ids"] == solo(engine, prompts[choice.index], 3)


def test_n_seeded_continuations_each_draw_their_own_stream(server, engine):
    body = {"prompt": "for i in range(", "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3, "ignore_eos": True,
            "return_token_ids": True}
    out = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT).json()
    ids = engine.encode("for i in range(")
    got = {c["index"]: c["token_ids"] for c in out["choices"]}
    assert sorted(got) == [0, 1, 2]
    for i in range(3):
        assert got[i] == solo(engine, ids, 8, SamplingParams(temperature=1.0, seed=11 + i))
    assert len({tuple(t) for t in got.values()}) > 1  # three streams, not one drawn three times
    assert out["usage"]["prompt_tokens"] == len(ids)  # one prompt, prefilled once


def test_n_and_prompts_stream_interleaved_choices(server, engine):
    body = {"prompt": ["x = ", "y = "], "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts: dict[int, str] = {}
    for frame in frames:
        for choice in frame["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts[0] == texts[1] == engine.decode(solo(engine, engine.encode("x = "), 4))
    assert texts[2] == texts[3] == engine.decode(solo(engine, engine.encode("y = "), 4))
    assert frames[-1]["usage"]["completion_tokens"] == 16


def test_too_many_choices_are_refused_naming_n(server):
    r = httpx.post(server.v1 + "/completions", json={"prompt": ["a"] * 100, "n": 3}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_chat_n_gives_indexed_choices_through_the_official_client(client):
    out = client.chat.completions.create(model="moekit-demo", messages=[{"role": "user", "content": "ls"}], n=2,
                                         max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content == out.choices[1].message.content  # greedy: the same continuation
    assert out.usage.completion_tokens == 8


def test_echo_of_token_ids_outside_the_vocabulary_is_a_400(server):
    for ids in ([-1, 5], [5, 2**70]):  # found by schemathesis: echo decoded them before they were checked
        r = httpx.post(server.v1 + "/completions", json={"prompt": ids, "echo": True, "max_tokens": 1}, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
