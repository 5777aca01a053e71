"""Chunked prefill seen from a client: a server that prefills 8 prompt tokens a step answers long
prompts, alone or arriving while other requests stream, with the tokens and prompt logprobs the
engine in this process gives each one alone (one whole prefill, fp32 greedy)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from server_process import start_server

pytestmark = pytest.mark.processes

openai = pytest.importorskip("openai")

LONG = ("NAME\n    ls - list directory contents\n\nSYNOPSIS\n    ls [OPTION]... [FILE]...\n\n"
        "DESCRIPTION\n    List information about the FILEs (the current directory by default).\n")
SHORT = ["def parse_args(argv):", "import os\n", "for i in range(", "class Stack:"]
TIMEOUT = httpx.Timeout(120.0)


@pytest.fixture(scope="module")
def server():
    s = start_server("--eager", "--max-batch", "8", "--max-prefill-tokens", "8")
    yield s
    assert s.stop() == 0


def solo(engine, prompt: str, new: int) -> list[int]:
    return engine.generate([engine.encode(prompt)], max_new_tokens=new, stop_ids=()).token_ids[0]


def ask(server, prompt: str, new: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_long_prompt_through_the_openai_client_gets_the_whole_prefills_text(client, engine):
    assert len(engine.encode(LONG)) > 4 * 8  # several chunks
    out = client.completions.create(model="moekit-demo", prompt=LONG, max_tokens=12, temperature=0)
    want = engine.generate([engine.encode(LONG)], max_new_tokens=12).token_ids[0]  # stops at the model's eos, as served
    assert out.choices[0].text == engine.decode(want)
    assert out.usage.prompt_tokens == len(engine.encode(LONG))


def test_long_prompts_arriving_while_others_stream_get_their_solo_tokens(server, engine):
    # Short requests with long outputs decode while long prompts (and a few more short ones) arrive.
    jobs = [(SHORT[i % len(SHORT)], 40 - 2 * i) for i in range(4)] + [(LONG, 10), (SHORT[1] + LONG, 6), (SHORT[2], 9)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: ask(server, *job), jobs))
    for (prompt, new), ids in zip(jobs, got):
        assert ids == solo(engine, prompt, new), prompt[:20]


def test_echo_logprobs_across_chunks_are_the_whole_forwards(client, engine):
    out = client.completions.create(model="moekit-demo", prompt=LONG, max_tokens=0, echo=True, logprobs=1, temperature=0)
    prompt = engine.encode(LONG)
    with torch.inference_mode():
        cache = engine.decoder.new_cache(1, len(prompt))
        logits = engine.decoder(torch.tensor([prompt]), cache, torch.arange(len(prompt))[None])  # [1, P, V]
    reference = torch.log_softmax(logits[0].float(), dim=-1)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) and lp.token_logprobs[0] is None
    expected = [float(reference[t - 1, prompt[t]]) for t in range(1, len(prompt))]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_a_prefill_budget_below_one_is_refused_in_one_line():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "moekit", "serve", "--max-prefill-tokens", "0", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--max-prefill-tokens must be at least 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr
