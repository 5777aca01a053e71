"""`moekit serve x.gguf` as `moekit run x.gguf`: the same tokens over HTTP as the checkpoint folder
it was converted from gives alone, its chat template from the file, and paging with pins."""

from __future__ import annotations

import httpx
import pytest

from moekit.engine.loader import load_engine
from serve.server_process import start_server

TIMEOUT = httpx.Timeout(120.0)


@pytest.fixture(scope="module")
def olmoe(converted):
    return converted("olmoe", "f32")


@pytest.mark.parametrize("paged", [False, True])
def test_serve_a_gguf_gives_the_folders_tokens(olmoe, paged):
    folder, gguf = olmoe
    args = ["--expert-memory", "50%", "--prefetch"] if paged else []
    # A paged start builds the C++ operators on a machine's first use: minutes, not seconds.
    server = start_server("--eager", gguf, *args, timeout=600 if paged else 120)
    try:
        models = httpx.get(server.v1 + "/models", timeout=TIMEOUT).json()
        assert models["data"][0]["id"] == gguf.stem
        body = {"prompt": [1, 17, 42, 5], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        reply = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT).json()
        want = load_engine(folder, compile=False).generate([[1, 17, 42, 5]], max_new_tokens=8, stop_ids=()).token_ids[0]
        assert reply["choices"][0]["token_ids"] == want
        chat = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.v1 + "/chat/completions", json=chat, timeout=TIMEOUT).status_code == 200
        if paged:
            assert "moekit:expert_cache_hits_total" in httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    finally:
        assert server.stop() == 0
