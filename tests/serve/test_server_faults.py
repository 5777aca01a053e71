"""What a client sees when things go wrong, on tiny checkpoints: no tokenizer, a corrupted paged
expert, a full queue, a checkpoint that does not load, and SIGTERM in the middle of a stream."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hf_tiny import write_checkpoint
from moekit.engine.loader import load_engine
from moekit.offload.options import OffloadOptions

TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A qwen3_moe checkpoint without tokenizer.json: it is served on token ids."""
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny"), seed=1)


def _solo(folder, prompt, new):
    return load_engine(folder, compile=False).generate([prompt], max_new_tokens=new, stop_ids=()).token_ids[0]


def test_a_model_without_tokenizer_streams_token_ids_with_empty_text(tiny, serve_process):
    server = serve_process("--eager", tiny)
    body = {"prompt": [5, 17, 42], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    per_token = [c for c in chunks if c["finish_reason"] is None]
    assert [c["token_ids"] for c in per_token] == [[t] for t in _solo(tiny, [5, 17, 42], 6)]
    assert {c["text"] for c in chunks} == {""}
    r = httpx.post(server.v1 + "/completions", json={"prompt": "text", "max_tokens": 2}, timeout=TIMEOUT)
    assert r.status_code == 400 and "no tokenizer.json" in r.json()["error"]["message"]
    r = httpx.post(server.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=TIMEOUT)
    assert r.status_code == 400 and "no tokenizer.json" in r.json()["error"]["message"]


def _touched(engine, prompt, new) -> set:
    gen = engine.generate([prompt], max_new_tokens=new, stop_ids=())
    return {(lr.layer, e) for step in gen.routing for lr in step.layers for e in lr.topk_ids.reshape(-1).tolist()}


def test_a_corrupted_paged_expert_fails_its_request_alone(tiny, tmp_path, serve_process):
    from moekit.weights.manifest import from_json

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    load_engine(folder, offload=OffloadOptions("25%"), compile=False).close()  # writes the checksum manifest
    manifest = from_json(json.loads((folder / "moekit-experts.json").read_text()))
    (layer, expert), entry = sorted(manifest.experts.items())[0]
    resident = load_engine(tiny, compile=False)
    candidates = [[t, 7] for t in range(3, 150)]
    bad = next(p for p in candidates if (layer, expert) in _touched(resident, p, 3))
    good = next(p for p in candidates if (layer, expert) not in _touched(resident, p, 3))
    extent = entry.extents[0]
    spoiled = bytearray((folder / extent.file).read_bytes())
    spoiled[extent.offset + 3] ^= 0x40
    (folder / extent.file).write_bytes(bytes(spoiled))

    server = serve_process("--eager", folder, "--expert-memory", "25%")

    def ask(prompt):
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        return httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)

    with ThreadPoolExecutor(2) as pool:
        failed, served = pool.map(ask, [bad, good])
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and f"layer {layer} expert {expert}" in error["message"]
    assert served.status_code == 200
    assert served.json()["choices"][0]["token_ids"] == _solo(tiny, good, 3)
    assert "expert_cache" in served.json()["usage"]["moe"]
    metrics = httpx.get(server.url + "/metrics").text
    assert "moekit:expert_cache_misses_total" in metrics and "moekit:request_failure_total 1.0" in metrics
    again = ask(good)  # the server goes on serving
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == _solo(tiny, good, 3)


def test_a_full_tier_queue_answers_429(tiny, serve_process):
    """One row, room for one waiting request: of 8 long requests sent at once, most are refused."""
    server = serve_process("--eager", tiny, "--max-batch", "1", "--queue-limit", "1")

    def ask(_):
        body = {"prompt": [5, 6], "max_tokens": 250, "temperature": 0, "ignore_eos": True}
        return httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(8)))
    statuses = [r.status_code for r in replies]
    assert 429 in statuses and 200 in statuses and set(statuses) == {200, 429}, statuses
    for r in replies:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and "queue is full" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 250


def test_sigterm_finishes_the_running_stream_then_exits_zero(tiny, serve_process):
    server = serve_process("--eager", tiny, "--grace", "30")
    body = {"prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        first = next(lines)
        server.proc.send_signal(signal.SIGTERM)
        frames = [first] + [line for line in lines]
    data = [f[6:] for f in frames if f.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
    assert len(data) == 120 + 2  # every token, the closing chunk, [DONE]
    assert server.proc.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)


def test_a_checkpoint_that_does_not_load_is_one_line_and_exit_2(tiny, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "moekit", "serve", str(folder), "--port", "0"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in done.stderr
    assert time.monotonic() - started < 120
    missing = subprocess.run([sys.executable, "-m", "moekit", "serve", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not a checkpoint folder" in missing.stderr


def test_each_request_reports_its_own_expert_cache_hits_and_misses(tiny, tmp_path, serve_process):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    body = {"prompt": [5, 17, 42, 9], "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    def cache_of(server):
        usage = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT).json()["usage"]
        return usage["moe"]["expert_cache"]

    no_cache = serve_process("--eager", folder, "--expert-memory", "25%", "--cache", "none")
    first = cache_of(no_cache)
    assert first["hits"] == 0 and first["misses"] > 0  # with no cache every use is a read
    lru = serve_process("--eager", folder, "--expert-memory", "75%", "--cache", "lru")
    cold, warm = cache_of(lru), cache_of(lru)
    assert cold["hits"] + cold["misses"] == warm["hits"] + warm["misses"] == first["misses"]
    assert warm["hits"] > cold["hits"]  # the same request again finds its experts resident
