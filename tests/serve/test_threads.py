"""The server's threads on the cores (moekit.serve.threads): the engine runs the torch threads asked
for, an idle server does not spin, and once the HTTP thread is seated (`serve --share-cores`) torch's
idle OpenMP threads sleep between parallel regions instead of spinning through the Python between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server_process import start_server

SRC = Path(__file__).resolve().parents[2] / "src"

# Runs in its own process on 2 CPUs (set before torch loads: libgomp counts them then) with 2 torch
# threads: parallel regions with 1 ms of Python between them, as in a decode step, before and after
# seat_http_thread. → the CPU seconds of every thread but the main one, each time.
PROBE = """
import json, os, threading, time
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
import torch
from moekit.serve.threads import engine_threads, seat_http_thread

def others_cpu_s():
    me, total = threading.get_native_id(), 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")

def regions(n=300):
    x = torch.ones(1 << 16)
    before = others_cpu_s()
    for _ in range(n):
        x.add_(1.0)
        start = time.perf_counter()
        while time.perf_counter() - start < 0.001:
            pass
    return others_cpu_s() - before

engine_threads(2)
spinning = regions()
seat_http_thread(threading.Event(), 2)
print(json.dumps({"unseated": spinning, "seated": regions(), "threads": torch.get_num_threads()}))
"""


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of every thread of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_idle_torch_threads_sleep_between_regions_once_the_http_thread_is_seated():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    cpu = json.loads(out.stdout)
    assert cpu["threads"] == 2  # the seat put torch's default back
    assert cpu["unseated"] > 0.05, cpu  # the idle worker spun through the gaps: the probe sees spinning
    assert cpu["seated"] < cpu["unseated"] / 4, cpu


@pytest.fixture(scope="module")
def two_thread_server():
    # Eager: the threads and the idle loop are the server's, whichever step it runs (docs/TESTING.md).
    server = start_server("--eager", "--max-batch", "4", "--share-cores", threads=2)
    yield server
    assert server.stop() == 0


def test_the_server_says_how_many_torch_threads_its_engine_runs(two_thread_server):
    line = next(line for line in two_thread_server.log if line.startswith("serving "))
    assert ", 2 torch threads, " in line, line


def test_an_idle_server_uses_almost_no_cpu_after_serving(two_thread_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=two_thread_server.v1, api_key="unused", timeout=120.0, max_retries=0)
    reply = client.completions.create(model="moekit-demo", prompt="Once upon a time", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 8  # the engine's OpenMP team exists and has worked
    pid = two_thread_server.proc.pid
    time.sleep(0.2)  # the reply's tail (the stream's close, metrics) is done
    before = process_cpu_s(pid)
    time.sleep(1.0)
    assert process_cpu_s(pid) - before < 0.1  # no thread polls: the engine waits on an event, the loop on sockets
