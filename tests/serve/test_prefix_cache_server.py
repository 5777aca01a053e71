"""Automatic prefix caching seen from a client: a repeated prompt prefix is reused (usage's
prompt_tokens_details.cached_tokens, /metrics' prefix_cache counters) and changes nothing else:
the greedy tokens and usage.moe are what a server without the cache answers."""

from __future__ import annotations

import httpx
import pytest

from server_process import start_server

openai = pytest.importorskip("openai")

SHARED = (
    "NAME\n    ls - list directory contents\n\nSYNOPSIS\n    ls [OPTION]... [FILE]...\n\n"
    "DESCRIPTION\n    List information about the FILEs (the current directory by default).\n"
)
SUFFIXES = ["    -a, --all", "    -l", "EXAMPLES\n", "    -a, --all"]  # the last repeats the first
TIMEOUT = httpx.Timeout(120.0)


@pytest.fixture(scope="module")
def servers():
    cached, cold = start_server("--eager", "--max-batch", "4"), start_server("--eager", "--max-batch", "4", "--prefix-cache-memory", "0")
    yield cached, cold
    assert cached.stop() == 0 and cold.stop() == 0


def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120.0, max_retries=0)


def counters(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if "prefix_cache" in s.name}


def complete(server, prompt: str, **extra):
    return client(server).completions.create(model="moekit-demo", prompt=prompt, max_tokens=16, temperature=0, **extra)


def test_a_shared_prefix_is_reused_and_gives_the_cold_tokens(servers):
    cached, cold = servers
    before = counters(cached)
    warm = [complete(cached, SHARED + s) for s in SUFFIXES]
    after = counters(cached)
    reused = [o.usage.prompt_tokens_details.cached_tokens for o in warm]
    assert reused[0] == 0 and all(n > 0 and n % 16 == 0 for n in reused[1:])
    assert reused[3] >= reused[1]  # the repeated prompt finds its own blocks, the suffix's too
    for suffix, out in zip(SUFFIXES, warm):
        want = complete(cold, SHARED + suffix)
        assert out.choices[0].text == want.choices[0].text
        # experts_touched included; the work done (expert bytes, FLOPs) is less: the cached prefix is not run again
        work = ("expert_bytes", "expert_flops", "flops")
        got, cold_moe = out.usage.model_extra["moe"], want.usage.model_extra["moe"]
        assert {k: v for k, v in got.items() if k not in work} == {k: v for k, v in cold_moe.items() if k not in work}
        assert all(got[k] <= cold_moe[k] for k in work)
        assert (got["flops"] < cold_moe["flops"]) == (out.usage.prompt_tokens_details.cached_tokens > 0)
        assert want.usage.prompt_tokens_details.cached_tokens == 0
    assert after["moekit:prefix_cache_queries_total"] - before.get("moekit:prefix_cache_queries_total", 0) == sum(
        o.usage.prompt_tokens for o in warm)
    assert after["moekit:prefix_cache_hits_total"] - before.get("moekit:prefix_cache_hits_total", 0) == sum(reused)
    assert counters(cold) == {}  # off: no prefix-cache counters at all


def test_a_chats_next_turn_reuses_its_history(servers):
    cached, cold = servers
    history = [{"role": "system", "content": SHARED}, {"role": "user", "content": "What does -l do?"}]
    first = client(cached).chat.completions.create(model="moekit-demo", messages=history, max_tokens=12, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And -a?"}]
    second = client(cached).chat.completions.create(model="moekit-demo", messages=history, max_tokens=12, temperature=0)
    want = client(cold).chat.completions.create(model="moekit-demo", messages=history, max_tokens=12, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 > 0
    assert second.choices[0].message.content == want.choices[0].message.content


def test_concurrent_requests_sharing_a_prefix_get_the_cold_tokens(servers):
    from concurrent.futures import ThreadPoolExecutor

    cached, cold = servers
    prompts = [SHARED + f"    -{c}" for c in "abcdefgh"]
    with ThreadPoolExecutor(8) as pool:
        warm = list(pool.map(lambda p: complete(cached, p, stream=False), prompts))
    for prompt, out in zip(prompts, warm):
        assert out.choices[0].text == complete(cold, prompt).choices[0].text


def test_streamed_usage_says_what_was_cached(servers):
    cached, _ = servers
    complete(cached, SHARED + "SEE ALSO\n")
    chunks = list(complete(cached, SHARED + "SEE ALSO\n", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("priority, status", [(-3, 200), (7, 200), ("high", 400), (1.5, 400)])
def test_priority_is_an_integer(servers, priority, status):
    cached, _ = servers
    body = {"prompt": "ls -l", "max_tokens": 2, "priority": priority}
    reply = httpx.post(cached.v1 + "/completions", json=body, timeout=TIMEOUT)
    assert reply.status_code == status
    if status == 400:
        assert reply.json()["error"]["param"] == "priority"
