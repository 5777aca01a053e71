"""`moekit serve` (the compiled decode step by default, --compile too): continuous batching through
the compiled step gives every client the tokens the eager engine gives its prompt alone (fp32
greedy); the step is compiled or loaded before the server says it serves. Each server here is a
cold compile of its own (the C++ caller, the servers' default): two servers, each checking all it can."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_process import start_server
from moekit.engine.loader import load_engine

# A server process answers these tests; tests/conftest.py keeps such tests from overlapping.
pytestmark = pytest.mark.processes


def _cache_counters(server) -> dict:
    lines = httpx.get(server.url + "/metrics", timeout=30.0).text.splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines)
            if name in ("moekit:expert_cache_hits_total", "moekit:expert_cache_misses_total")}


def _warmed_up_before_serving(server) -> None:
    """The step runs compiled, and its warm-up's line (compiling or loading, then its seconds) comes
    before the server says it serves."""
    assert any("compiled graph" in line for line in server.log), server.log[-5:]
    warm = [i for i, line in enumerate(server.log) if "the compiled decode step" in line or "compiling the decode step" in line]
    serving = [i for i, line in enumerate(server.log) if line.startswith("serving ")]
    assert len(warm) == 1 and serving and warm[0] < serving[0], server.log
    assert server.log[warm[0]].rstrip().endswith(" s"), server.log[warm[0]]


def test_a_compiled_paged_server_gives_its_clients_their_solo_tokens_and_reads_as_the_eager_one(tiny_checkpoints):
    """`moekit serve --expert-memory --prefetch` (compiled by default): the store's layers and guesses run inside
    the compiled step (moekit.offload.graph_store). The warm-up reads nothing, so a first request
    hits and misses as on an eager server; concurrent clients, more than its rows and leaving at
    different steps (a batch's graph, rows admitted as others leave), get their solo tokens.
    (This server is the compiled default's continuous batching test too: one cold compile fewer
    than a second server of the bundled model.)"""
    openai = pytest.importorskip("openai")
    folder = tiny_checkpoints("qwen3_moe")
    store = ("--expert-memory", "25%", "--prefetch", "--max-batch", "4")
    jobs = [([1, 17, 42, 9, 33], 12), ([5, 77, 3], 7), ([8, 8, 8, 8], 10), ([2], 5), ([40, 41, 42, 43], 9)]
    engine = load_engine(folder, compile=False)
    try:
        solo = [engine.generate([p], max_new_tokens=n, stop_ids=()).token_ids[0] for p, n in jobs]
    finally:
        engine.close()

    def ask(client, job) -> tuple[list[int], dict]:
        prompt, new = job
        reply = client.completions.create(model=folder.name, prompt=prompt, max_tokens=new, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        return reply.choices[0].model_extra["token_ids"], reply.usage.model_extra["moe"]["expert_cache"]

    first = {}
    for args in (("--eager",), ()):
        server = start_server(folder, *store, *args, timeout=600)  # a cold compile of both graphs
        try:
            client = openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120.0, max_retries=0)
            first[args] = (_cache_counters(server), ask(client, jobs[0]), _cache_counters(server))
            if not args:
                _warmed_up_before_serving(server)
                # Paged experts keep a prompt on the modules' forward (prefill_step.takes): no prefill graph
                # is compiled for it, while an unpaged server's lines name its prefills (the MXFP4 one below).
                assert not any("prefill graph" in line for line in server.log), server.log
                with ThreadPoolExecutor(len(jobs)) as pool:  # 5 clients, 4 rows: one waits for a row to leave
                    got = list(pool.map(lambda job: ask(client, job)[0], jobs))
                assert got == solo
        finally:
            assert server.stop() == 0, server.log[-5:]
    eager, compiled = first[("--eager",)], first[()]
    assert compiled[1][0] == solo[0]
    assert compiled == eager  # nothing counted before the request; the same hits and misses for it
    assert eager[1][1]["misses"] > 0 and eager[2]["moekit:expert_cache_misses_total"] == eager[1][1]["misses"]
    assert set(eager[0].values()) == {0.0}


def _prefill_graphs_ready(server, shapes: int, timeout: float = 600) -> list[str]:
    """The server's lines that say each of its prefill graphs is ready, once there are `shapes` of them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [line for line in list(server.log) if line.startswith("prefill graph (")]
        if len(done) >= shapes or server.proc.poll() is not None:
            return done
        time.sleep(0.2)
    return done


def _health(server, until_ready: bool = False) -> dict:
    """/health's JSON; until_ready: asked again for up to 30 s until it says the graphs are ready (the
    server marks them ready just after it prints the last graph's line, which a loaded machine can
    stretch past the client's next request)."""
    deadline = time.monotonic() + 30
    while True:
        got = httpx.get(server.url + "/health", timeout=30).json()
        if not until_ready or got.get("graphs") == "ready" or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_a_compiled_server_with_mxfp4_experts_kept_packed_gives_the_solo_eager_tokens(tmp_path):
    """gpt-oss's MXFP4 experts, kept packed, in the compiled server's batches (moekit::experts_mxfp4
    called by the generated C++): each client gets the tokens the eager engine gives its prompt alone,
    as soon as the server answers (its prompts on the modules' forward while their prefill graphs
    compile beside the steps) and after its prefill graphs are ready (its prompts by the graphs).
    Its context (--max-context 128) is no longer than a step's prefill tokens (128, the default), so no
    prompt is prefilled in chunks: no graph of a chunk before the last (compiled_step.served_prefills;
    tests/model/test_prefill_step.py prefills chunks through that graph)."""
    from quantized_files import write_mxfp4

    folder = write_mxfp4(tmp_path / "mxfp4")
    packed = start_server(folder, "--max-batch", "4", "--max-context", "128", "--compile", timeout=600)
    try:
        engine = load_engine(folder, compile=False)
        jobs = [([1, 17, 42, 99, 5, 63], 10), ([12, 40, 41], 6), ([5, 9, 33, 7, 81, 14, 3, 60], 8)]
        solo = [engine.generate([prompt], max_new_tokens=new, stop_ids=()).token_ids[0] for prompt, new in jobs]

        def ask(job):
            prompt, new = job
            body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            return httpx.post(packed.v1 + "/completions", json=body, timeout=120.0).json()["choices"][0]["token_ids"]

        health = []
        for when in ("while the prefill graphs compile", "once they are ready"):
            health.append(_health(packed, until_ready=when == "once they are ready"))
            with ThreadPoolExecutor(len(jobs)) as pool:
                assert list(pool.map(ask, jobs)) == solo
            ready = _prefill_graphs_ready(packed, 2)
            assert len(ready) == 2 and all(line.endswith("its prompts run it from now") for line in ready), packed.log
        # /health says whether the prefill graphs are loaded (what `moekit bench serve` waits for before timing)
        assert health == [{"status": "ok", "graphs": "loading"}, {"status": "ok", "graphs": "ready"}], packed.log
        _warmed_up_before_serving(packed)
        decode = next(i for i, line in enumerate(packed.log) if "decode step" in line)
        started = [i for i, line in enumerate(packed.log) if "the prefill graphs (1 row full, 2 rows full) one at a time" in line]
        assert started and started[0] > decode, packed.log  # begun once the decode graphs were ready
    finally:
        assert packed.stop() == 0


def _own_home(tmp_path: Path) -> dict:
    """An environment whose HOME is a fresh folder (an empty compile cache) with the operator build linked."""
    home = tmp_path / "home"
    (home / ".cache" / "moekit").mkdir(parents=True)
    ops = Path.home() / ".cache" / "moekit" / "ops"
    if ops.is_dir():
        (home / ".cache" / "moekit" / "ops").symlink_to(ops)  # not rebuilt
    return {**os.environ, "HOME": str(home)}


def test_a_server_stopped_while_compiling_exits_0_and_one_warmed_up_ahead_loads_every_graph(tiny_checkpoints, tmp_path):
    """On one compile cache of its own, one row (--max-batch 1: no batch graph, no graph of several
    prompts' rows; --max-context 128, a step's prefill tokens: no graph of a chunk), three
    processes one after another. A server stopped as soon as it answers, its
    prefill graphs compiling beside the steps, exits 0 at once: torch's compile cannot be interrupted,
    and a process that exited under it aborted. `moekit serve --warm-up` then loads the decode graph that
    server compiled, compiles (or loads) its prefill graphs and exits without serving; the server after
    it loads every graph and answers with the eager tokens. (One cold decode graph for the three: the
    graphs a server would use are the same whether it was stopped, warmed up ahead or serves.)"""
    folder = tiny_checkpoints("qwen3_moe")
    args, env = (folder, "--max-batch", "1", "--max-context", "128"), _own_home(tmp_path)
    stopped = start_server(*args, timeout=600, env=env)
    assert stopped.stop() == 0, stopped.log[-5:]
    assert not any("terminate called" in line for line in stopped.log), stopped.log[-5:]
    assert any("compiling the decode step (batch 1)" in line for line in stopped.log), stopped.log

    ahead = subprocess.run([sys.executable, "-m", "moekit", "serve", *map(str, args), "--warm-up", "--threads", "1"],
                           capture_output=True, text=True, timeout=900, env=env)
    assert ahead.returncode == 0, ahead.stderr[-2000:]
    lines = ahead.stderr.splitlines()
    assert any("loading the compiled decode step (batch 1)" in line for line in lines), lines
    assert [line.split(")")[0] for line in lines if line.startswith("prefill graph (")] == ["prefill graph (1 row full"], lines
    assert lines[-1].startswith("warmed up: ") and not any(line.startswith("serving ") for line in lines), lines

    server = start_server(*args, timeout=600, env=env)
    try:
        ready = _prefill_graphs_ready(server, 1)
        assert len(ready) == 1 and all(" loaded in " in line for line in ready), server.log
        assert any(line.startswith("loading the compiled decode step (batch 1) from") for line in server.log), server.log
        prompt = [5, 9, 33, 7, 81, 14, 3, 60]
        want = load_engine(folder, compile=False).generate([prompt], max_new_tokens=6, stop_ids=()).token_ids[0]
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        assert httpx.post(server.v1 + "/completions", json=body, timeout=120.0).json()["choices"][0]["token_ids"] == want
    finally:
        assert server.stop() == 0
