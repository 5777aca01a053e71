"""`moekit serve --expert-parallel`: real rank processes (gloo on loopback) behind a real server,
driven by the official OpenAI client.

One sharded server per family answers every assertion about it: greedy fp32 tokens of 8
concurrent clients (two of them streaming) equal to what the engine gives each prompt alone in
this process (the single-process server's answer: tests/serve/test_server.py), the exchange per
rank in /metrics (rank 1 holding no dense weights), and SIGTERM that drains and stops every rank.
qwen3_moe runs a placement that replicates two experts on both ranks, and takes a hot swap (and its
rollback) of a replicated expert and of one only rank 1 holds. A rank killed or stopped mid-stream
gives 503s naming it, /health 503, and every process exits. Two torchrun agents on a loopback
rendezvous serve the same tokens; a third agent pair, one given other weights, is refused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import save

from server_process import start_server
from moekit.engine.loader import load_engine

pytestmark = pytest.mark.processes

openai = pytest.importorskip("openai")

PROMPTS = [[1, 17, 42, 9, 33], [5, 77, 3], [8, 8, 8, 8, 8, 8, 8], [2], [40, 41, 42, 43], [11, 12], [90, 3, 7], [6, 60, 6]]
TIMEOUT = httpx.Timeout(60.0)
# qwen3_moe's tiny checkpoint: 2 MoE layers of 8 experts; experts 1 and 6 copied onto both ranks.
TOKEN = "s3cret"
REPLICAS = {"0": [[0, 1, 2, 3, 6], [4, 5, 6, 7, 1]], "1": [[0, 1, 2, 3, 6], [4, 5, 6, 7, 1]]}


def _worker_pids(server) -> list[int]:
    return [int(m.group(1)) for line in server.log for m in [re.search(r"started expert-parallel rank \d+ \(pid (\d+)\)", line)] if m]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie is gone too (its parent has not reaped it yet)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def _wait_gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return all(_gone(p) for p in pids)


FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss"]
every_family = pytest.mark.parametrize("sharded", FAMILIES, indirect=True)


@pytest.fixture(scope="module")
def sharded(request, tiny_checkpoints, tmp_path_factory):
    """(family, its checkpoint, a 2-rank server of it); the server must drain, exit 0 and take its ranks along."""
    family = request.param
    folder = tiny_checkpoints(family)
    args = [folder, "--eager", "--expert-parallel", "2", "--ep-timeout", "30", "--max-batch", "8"]
    if family == "qwen3_moe":
        placement = tmp_path_factory.mktemp("placement") / "replicas.json"
        placement.write_text(json.dumps({"format": "moekit-placement", "version": 1, "ranks": 2,
                                         "layers": {l: {"num_experts": 8, "ranks": r} for l, r in REPLICAS.items()}}))
        args += ["--placement", placement, "--admin-token", TOKEN]
    server = start_server(*args)
    yield family, folder, server
    workers = _worker_pids(server)
    assert server.stop() == 0, server.log
    assert _wait_gone(workers, 15), f"ranks {workers} outlived the server"


def _solo(folder, jobs) -> list[list[int]]:
    engine = load_engine(folder, compile=False)
    try:
        return [engine.generate([p], max_new_tokens=n, stop_ids=()).token_ids[0] for p, n in jobs]
    finally:
        engine.close()


@every_family
def test_eight_concurrent_clients_get_the_single_process_tokens(sharded):
    family, folder, server = sharded
    client = openai.OpenAI(base_url=server.v1, api_key="unused", timeout=60.0, max_retries=0)
    jobs = [(PROMPTS[i], 5 + 2 * i) for i in range(8)]  # rows leave at different steps

    def ask(i: int) -> list[int]:
        prompt, new = jobs[i]
        extra = {"ignore_eos": True, "return_token_ids": True}
        if i % 4 == 3:  # two of them stream
            stream = client.completions.create(model=folder.name, prompt=prompt, max_tokens=new, temperature=0,
                                               stream=True, extra_body=extra)
            return [t for chunk in stream for c in chunk.choices for t in (c.model_extra.get("token_ids") or [])]
        reply = client.completions.create(model=folder.name, prompt=prompt, max_tokens=new, temperature=0, extra_body=extra)
        assert reply.usage.model_extra["moe"]["experts_touched"] > 0  # usage.moe as on one process
        return reply.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == _solo(folder, jobs), family


def _ep_metrics(server) -> dict:
    values = {}
    for line in httpx.get(server.url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith("moekit:ep_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


@every_family
def test_metrics_show_each_ranks_exchange(sharded):
    family, folder, server = sharded
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT).status_code == 200
    done = time.monotonic()
    while True:  # the server gathers its ranks' figures once a second
        values = _ep_metrics(server)
        if values.get('moekit:ep_steps_total{rank="1"}', 0) > 0 and time.monotonic() - done > 1.5:
            break
        assert time.monotonic() - done < 20, values
        time.sleep(0.3)
    for rank in ("0", "1"):
        for metric in ("exchange_seconds_total", "steps_total"):
            assert values[f'moekit:ep_{metric}{{rank="{rank}"}}'] > 0, (metric, rank)
        for kind in ("dispatch", "combine", "all_gather"):
            assert values[f'moekit:ep_sent_bytes_total{{kind="{kind}",rank="{rank}"}}'] > 0, (kind, rank)
    # rank 0 broadcasts each MoE layer's tokens and routing; rank 1 receives exactly that
    assert values['moekit:ep_sent_bytes_total{kind="broadcast",rank="0"}'] == \
        values['moekit:ep_received_bytes_total{kind="broadcast",rank="1"}'] > 0
    # what one rank dispatches, the other receives (two ranks)
    assert values['moekit:ep_sent_bytes_total{kind="dispatch",rank="0"}'] == \
        values['moekit:ep_received_bytes_total{kind="dispatch",rank="1"}']
    for rank in ("0", "1"):
        served = [v for k, v in values.items() if k.startswith("moekit:ep_expert_tokens_total") and f'rank="{rank}"' in k]
        assert sum(served) > 0
    # a follower holds its experts and none of the weights only rank 0 runs (dist/rank_memory.py)
    assert values['moekit:ep_weight_bytes{kind="dense",rank="1"}'] == 0
    assert values['moekit:ep_weight_bytes{kind="dense",rank="0"}'] > 0
    assert values['moekit:ep_weight_bytes{kind="experts",rank="1"}'] > 0
    balance = [v for k, v in values.items() if k.startswith("moekit:ep_balancedness")]
    assert balance and all(0 < v <= 1 for v in balance)
    if family == "qwen3_moe":  # a replicated expert's tokens are split between its two copies
        copies = [k for k in values if k.startswith("moekit:ep_expert_tokens_total") and 'expert="6"' in k and 'layer="1"' in k]
        assert {re.search(r'rank="(\d)"', k).group(1) for k in copies} == {"0", "1"}


@every_family
def test_a_dropped_stream_is_cancelled_and_the_next_request_is_exact(sharded):
    family, folder, server = sharded
    body = {"prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
        for n, line in enumerate(r.iter_lines()):
            if n >= 3:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
        if "moekit:num_requests_running 0.0" in metrics:
            break
        time.sleep(0.2)
    assert "moekit:num_requests_running 0.0" in metrics
    again = {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    ids = httpx.post(server.v1 + "/completions", json=again, timeout=TIMEOUT).json()["choices"][0]["token_ids"]
    assert ids == _solo(folder, [(PROMPTS[2], 6)])[0]


def test_the_compiled_step_sharded_gives_the_single_process_tokens(tiny_checkpoints):
    """--compile at 2 ranks: rank 0's decode step is one compiled graph that calls each MoE layer's
    exchange as an opaque op (moekit.dist.graph_exchange); the tokens are the single process's."""
    folder = tiny_checkpoints("qwen3_moe")
    server = start_server(folder, "--expert-parallel", "2", "--ep-timeout", "120", "--max-batch", "4", "--compile",
                          timeout=300)
    workers = _worker_pids(server)
    try:
        assert any("decode steps run as one compiled graph" in line for line in server.log), server.log
        jobs = [(PROMPTS[i], 6 + 3 * i) for i in range(4)]

        def ask(i: int) -> list[int]:
            body = {"prompt": jobs[i][0], "max_tokens": jobs[i][1], "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            return httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, range(4)))
        assert got == _solo(folder, jobs)
    finally:
        assert server.stop() == 0, server.log
    assert _wait_gone(workers, 15), f"ranks {workers} outlived the server"


def test_the_compiled_step_sharded_over_paged_experts_gives_the_single_process_tokens(tiny_checkpoints):
    """--compile with --expert-memory at 2 ranks: each rank's experts paged by its own store, rank 0's
    step compiled with the exchange as its opaque op (the store is attached before the step compiles).
    Its requests come one after another: one row (no batch graph to compile that they would not run)."""
    folder = tiny_checkpoints("qwen3_moe")
    server = start_server(folder, "--expert-parallel", "2", "--ep-timeout", "120", "--max-batch", "1",
                          "--expert-memory", "50%", "--compile", timeout=300)
    workers = _worker_pids(server)
    try:
        assert any("decode steps run as one compiled graph" in line for line in server.log), server.log
        jobs = [(PROMPTS[i], 6 + 2 * i) for i in range(2)]
        body = [{"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True} for p, n in jobs]
        got = [httpx.post(server.v1 + "/completions", json=b, timeout=TIMEOUT).json()["choices"][0]["token_ids"] for b in body]
        assert got == _solo(folder, jobs)
    finally:
        assert server.stop() == 0, server.log
    assert _wait_gone(workers, 15), f"ranks {workers} outlived the server"


def _new_expert(experts, seed: int) -> dict:
    f, d = experts.in_features[1], experts.in_features[0]
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=gen) * 0.3
            for name, shape in (("gate_proj.weight", (f, d)), ("up_proj.weight", (f, d)), ("down_proj.weight", (d, f)))}


# On the server whose placement replicates experts (the other families' servers have no admin token).
@pytest.mark.parametrize("sharded", ["qwen3_moe"], indirect=True)
def test_a_hot_swap_reaches_every_copy_and_rolls_back(sharded):
    family, folder, server = sharded
    jobs = [(PROMPTS[i], 10) for i in range(3)]
    engine = load_engine(folder, compile=False)
    swaps = [(1, 6), (0, 4)]  # layer 1's expert 6 has a copy on each rank; layer 0's expert 4 lives on rank 1
    bodies = {}
    for seed, (layer, expert) in enumerate(swaps):
        experts = engine.decoder.layers[layer].ffn.experts
        tensors = _new_expert(experts, seed)
        bodies[(layer, expert)] = save(tensors)
        gate_up = torch.cat([tensors["gate_proj.weight"], tensors["up_proj.weight"]])
        experts.replace_expert(expert, (experts.kernels[0].prepare(gate_up), experts.kernels[1].prepare(tensors["down_proj.weight"])))
    swapped = [engine.generate([p], max_new_tokens=n, stop_ids=()).token_ids[0] for p, n in jobs]
    engine.close()
    original = _solo(folder, jobs)
    assert swapped != original  # the new experts are used by these prompts

    def ask() -> list[list[int]]:
        out = []
        for prompt, new in jobs:
            body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            out.append(httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["token_ids"])
        return out

    auth = {"authorization": f"Bearer {TOKEN}"}
    for (layer, expert), raw in bodies.items():
        r = httpx.post(f"{server.url}/admin/experts/{layer}/{expert}", content=raw, headers=auth, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["swapped"], r.text
    assert ask() == swapped
    canary = httpx.post(f"{server.url}/admin/experts/1/6?canary=0.5", content=bodies[(1, 6)], headers=auth, timeout=TIMEOUT)
    assert canary.status_code == 409 and "--expert-parallel" in canary.json()["error"]["message"]
    for layer, expert in swaps:
        r = httpx.post(f"{server.url}/admin/experts/{layer}/{expert}/rollback", headers=auth, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["rolled_back"], r.text
    assert ask() == original


def test_a_killed_rank_gives_503s_naming_it_and_every_process_exits(tiny_checkpoints):
    timeout_s = 30  # joining 3 ranks on a loaded 2-core machine takes a while too
    server = start_server("--eager", tiny_checkpoints("qwen3_moe"), "--expert-parallel", "3", "--ep-timeout", str(timeout_s))
    workers = _worker_pids(server)
    try:
        assert len(workers) == 2
        body = {"prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
        frames = []
        started = time.monotonic()
        with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    frames.append(line[6:])
                    if len(frames) == 2:
                        os.kill(workers[0], 9)  # rank 1
                        started = time.monotonic()
        bound = timeout_s + 5
        assert time.monotonic() - started < bound
        assert frames[-1] == "[DONE]"
        error = json.loads(frames[-2])["error"]
        assert error["type"] == "service_unavailable" and "rank 1" in error["message"], error
        health = httpx.get(server.url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        late = httpx.post(server.v1 + "/completions", json={**body, "stream": False}, timeout=TIMEOUT)
        assert late.status_code == 503 and "rank 1" in late.json()["error"]["message"]
        assert server.proc.wait(bound) != 0
        assert any("rank 1" in line for line in server.log[-3:]), server.log
        assert _wait_gone(workers, 15), f"ranks {workers} outlived the server"
    finally:
        server.stop()


@pytest.mark.parametrize("when", ["mid_stream", "idle"])
def test_a_stopped_rank_gives_503s_naming_it_within_the_timeout(tiny_checkpoints, when):
    """SIGSTOP: a rank that neither answers nor closes its sockets. Mid-stream, rank 0's exchange
    times out; idle, its broadcasts still succeed and the rank's silent heartbeat gives it away."""
    timeout_s = 10
    server = start_server("--eager", tiny_checkpoints("qwen3_moe"), "--expert-parallel", "2", "--ep-timeout", str(timeout_s))
    workers = _worker_pids(server)
    body = {"prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    bound = timeout_s + 6  # the timeout, the culprit's naming (≤ 1 s) and a loaded machine's slack
    try:
        assert len(workers) == 1
        if when == "mid_stream":
            frames = []
            with httpx.stream("POST", server.v1 + "/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        frames.append(line[6:])
                        if len(frames) == 2:
                            os.kill(workers[0], signal.SIGSTOP)
                            stopped = time.monotonic()
            assert time.monotonic() - stopped < bound
            assert frames[-1] == "[DONE]"
            error = json.loads(frames[-2])["error"]
            assert error["type"] == "service_unavailable" and "rank 1 stopped answering" in error["message"], error
        else:
            os.kill(workers[0], signal.SIGSTOP)
            stopped = time.monotonic()
            late = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)  # blocks on the stopped rank
            assert time.monotonic() - stopped < bound
            assert late.status_code == 503, late.text
            error = late.json()["error"]
            assert "rank 1 stopped answering" in error["message"] and set(error) == {"message", "type", "param", "code"}
        health = httpx.get(server.url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        new = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)
        assert new.status_code == 503 and "rank 1" in new.json()["error"]["message"]
        assert server.proc.wait(bound) != 0
        assert any("rank 1 stopped answering" in line for line in server.log[-3:]), server.log
        assert _wait_gone(workers, 15), f"rank {workers} outlived the server"
    finally:
        for pid in workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        server.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_agents(folders: list, logs: list) -> list:
    """Two "machines": a torchrun agent per folder, meeting at a c10d rendezvous on loopback, one
    rank each (agent i serves folders[i]; its stderr goes to logs[i])."""
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).parent / "torchrun"
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = []
    for folder, log in zip(folders, logs):
        with open(log, "w") as err:
            agents.append(subprocess.Popen(
                [torchrun, "--nnodes", str(len(folders)), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", endpoint, "--rdzv-id", "moekit-test", "-m", "moekit", "serve", folder,
                 "--eager", "--expert-parallel", "auto", "--port", "0", "--threads", "1", "--ep-timeout", "60"],
                stdout=subprocess.DEVNULL, stderr=err))
    return agents


def _stop_agents(agents: list) -> None:
    for agent in agents:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_two_torchrun_agents_on_loopback_serve_the_single_process_tokens(tiny_checkpoints, tmp_path):
    folder = tiny_checkpoints("deepseek_v3")
    logs = [tmp_path / f"agent{i}.err" for i in range(2)]
    agents = []
    try:
        agents = _torchrun_agents([folder, folder], logs)
        url, deadline = None, time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            for log in logs:
                m = re.search(r"^serving .* on (http://[\d.:]+)/v1", log.read_text(), re.M)
                url = url or (m and m.group(1))
            assert all(a.poll() is None for a in agents), [l.read_text()[-2000:] for l in logs]
            time.sleep(0.3)
        assert url, [l.read_text()[-2000:] for l in logs]
        jobs = [(PROMPTS[i], 6 + i) for i in range(4)]

        def ask(job) -> list[int]:
            body = {"prompt": job[0], "max_tokens": job[1], "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            return httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, jobs))
        assert got == _solo(folder, jobs)
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        for agent in agents:  # torchrun stops its rank; rank 0 drains and tells rank 1 to leave
            agent.wait(60)
    finally:
        _stop_agents(agents)


def test_a_rank_started_on_other_weights_is_refused_naming_it(tiny_checkpoints, tmp_path):
    """Agent 1 is given a copy of the checkpoint with one expert tensor changed: no server starts,
    rank 0 says in one line that rank 1 loaded a different checkpoint, and both agents fail."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moekit.weights.manifest import MANIFEST_NAME

    folder = tiny_checkpoints("qwen3_moe")
    other = tmp_path / "other" / folder.name
    shutil.copytree(folder, other)
    # Another test's paged run may have left the expert store's checksum manifest beside the shared
    # tiny checkpoint: copied, it would make rank 1 refuse its changed tensor as corrupt and exit
    # before the ranks compare fingerprints. The copy is another checkpoint, not a corrupted one.
    (other / MANIFEST_NAME).unlink(missing_ok=True)
    (weights,) = other.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in sorted(tensors) if ".experts.3.down_proj" in n)
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, weights, metadata={"format": "pt"})
    logs = [tmp_path / f"agent{i}.err" for i in range(2)]
    agents = []
    try:
        agents = _torchrun_agents([folder, other], logs)
        codes = [a.wait(180) for a in agents]
        text = [l.read_text() for l in logs]
        assert all(c != 0 for c in codes), (codes, text)
        assert "serving " not in text[0]
        refusal = [l for l in text[0].splitlines() if l.startswith("error: ")]
        assert len(refusal) == 1 and "rank 1 loaded a different checkpoint than rank 0" in refusal[0], text[0][-3000:]
        assert "Traceback" not in text[0].split(refusal[0])[0], text[0][-3000:]  # the rank's; torchrun's own follows
    finally:
        _stop_agents(agents)
