"""No request body breaks the server: malformed JSON and out-of-range values are 400s in OpenAI's
shape, fields are typed as JSON Schema types them, and a request that fails while it is set up
fails alone while others stream."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest


TIMEOUT = httpx.Timeout(120.0)


def post(server, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT)


MALFORMED = [
    (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", None, "nests deeper"),
    (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nests deeper"),
    (b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}", None, "not valid JSON"),
    (b'{"prompt": "\\ud800"}', "prompt", "lone UTF-16 surrogate"),
    (b'{"prompt": ["ok", "\\udfff tail"]}', "prompt.1", "lone UTF-16 surrogate"),
    (b'{"prompt": "hi", "temperature": NaN}', None, "NaN is not a JSON number"),
    (b'{"prompt": "hi", "temperature": 1e999}', "temperature", "finite"),
    (b'{"prompt": "hi", "seed": 18446744073709551616}', "seed", "64-bit"),
    (b'{"prompt": "hi", "seed": -9223372036854775809}', "seed", "64-bit"),
    (b"\xff\xfe", None, "not valid JSON"),
    (b'{"prompt": "hi", "stop": ' + b'["a"]' + b"}", None, None),  # a valid body: the control
]


@pytest.mark.parametrize("raw, param, message", MALFORMED)
def test_malformed_bodies_are_400s_in_openais_shape(server, raw, param, message):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = post(server, path, raw.replace(b'"prompt"', b'"tokens"') if path == "/detokenize" else raw)
        if message is None:
            assert r.status_code < 500
            continue
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        if path == "/v1/completions" or param is None:  # a body-level fault reads the same on every route
            assert message in error["message"] and error["param"] == param, (path, error)


TYPED = [
    ({"max_tokens": 7.0}, 200, None),  # JSON has one number type: 7.0 is an integer
    ({"max_tokens": 7.5}, 400, "max_tokens"),
    ({"max_tokens": "7"}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"temperature": 0}, 200, None),
    ({"temperature": "0.5"}, 400, "temperature"),
    ({"temperature": True}, 400, "temperature"),
    ({"top_p": False}, 400, "top_p"),
    ({"seed": 3.0, "temperature": 0.7}, 200, None),
    ({"n": "2"}, 400, "n"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"stream": "yes"}, 400, "stream"),
]


@pytest.mark.parametrize("fields, status, param", TYPED)
def test_fields_are_typed_as_json_schema_types_them(server, fields, status, param):
    body = {"prompt": "hi", "max_tokens": 2, **fields}
    r = post(server, "/v1/completions", json.dumps(body).encode())
    assert r.status_code == status, r.text
    if param:
        assert r.json()["error"]["param"] == param


def test_405_says_which_methods_are_allowed(server):
    for method, path, allowed in [("GET", "/v1/completions", "POST"), ("DELETE", "/v1/models", "GET"), ("PUT", "/tokenize", "POST")]:
        r = httpx.request(method, server.url + path, timeout=TIMEOUT)
        assert r.status_code == 405 and r.headers["allow"] == allowed and r.json()["error"]["type"]


def test_a_request_refused_at_setup_leaves_eight_streams_running(server, engine):
    prompts = [f"def f{i}(x):" for i in range(8)]

    def stream(prompt):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        ids = []
        with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
        return ids

    with ThreadPoolExecutor(9) as pool:
        running = [pool.submit(stream, p) for p in prompts]
        bad = [post(server, "/v1/completions", json.dumps({"prompt": "x", "temperature": 1, "seed": seed}).encode())
               for seed in (2**64, -(2**63) - 1)]
        outputs = [f.result() for f in running]
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "seed" for r in bad)
    for prompt, ids in zip(prompts, outputs):
        assert ids == engine.generate([engine.encode(prompt)], max_new_tokens=24, stop_ids=()).token_ids[0]
    assert httpx.get(server.url + "/health").status_code == 200
