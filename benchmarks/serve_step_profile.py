"""Where a served token's time goes at c = 1: `moekit serve` sampled by py-spy while one client
streams 64-token completions of 8-token id prompts, against llama-server's ITL in the same run.

Each py-spy sample (busy Python threads only, native frames included) goes in one bucket by its
stack, the deepest region first:
  forward: kernels     the leaf is a compute or copy routine under moekit/model, moekit/ops or torch.nn
                       (MKL's gemv/gemm, oneDNN, ATen's vectorised loops, moekit's operators, libc's memcpy)
  forward: dispatch    the leaf is other native code there: torch's argument parsing, dispatcher,
                       tensor allocation and metadata (the C++ cost of each operator call)
  forward: Python      the leaf is Python there: the interpreter's time around the operators
  sampling             moekit/engine/sampling.py, logprobs, the scheduler's _sample (the token's choice)
  HTTP/streaming       uvicorn, starlette, fastapi, anyio, asyncio, h11/httptools, json, moekit/serve,
                       and the scheduler's hand-off of each token to its request's stream
  scheduler            moekit/engine/scheduler.py outside the above (slots, rows, the meter)
  other                anything else (detokenizing, threading)
A thread blocked on a lock, a queue or a selector is idle, whatever py-spy's --native makes of it:
such samples are dropped.
and is turned into milliseconds per output token: samples / rate / tokens streamed meanwhile.

py-spy is a benchmark tool, not a dependency: `python3 -m venv bench-out/tools &&
bench-out/tools/bin/pip install py-spy==0.4.3`. It needs ptrace (root in this container has it).

  .venv/bin/python benchmarks/serve_step_profile.py models/moekit-demo --seconds 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

from moekit.bench.serve import LoadPlan, first_model, run_level
from moekit.bench.serve_peers import ServeSetup, Workload, checkpoint_vocab, engine_command, parse_vs
from moekit.bench.server_launch import free_port, running

FORWARD = ("moekit/model/", "moekit/ops/", "torch/nn/", "torch/_ops.py", "torch/functional.py")
SAMPLING = ("moekit/engine/sampling.py", "moekit/engine/logprobs.py", "Scheduler._sample (")
IDLE = ("PyThread_acquire_lock_timed", "epoll_wait", "select (selectors.py", "Event.wait (", "Condition.wait (",
        "_queue_SimpleQueue_get")
SCHEDULER = ("moekit/engine/scheduler.py",)
KERNELS = ("mkl_", "dnnl", "gemm", "gemv", "cpublas", "vectorized_loop", "VectorizedLoop", "vec::", "Vectorized<",
           "moekit_ops", "libgomp", "(libc.so")
HTTP = ("uvicorn/", "starlette/", "fastapi/", "anyio/", "asyncio/", "h11/", "httptools", "json/", "moekit/serve/",
        "sse_starlette/", "selectors.py")


def bucket(stack: list[str]) -> str:
    """One sample's bucket; `stack` is root → leaf, each frame 'function (file:line)' or a native symbol."""
    def has(marks) -> bool:
        return any(m in frame for frame in stack for m in marks)

    leaf = stack[-1]
    if any(m in frame for frame in stack[-4:] for m in IDLE):
        return "idle"
    if has(FORWARD):
        if ".py:" in leaf:
            return "forward: Python"
        return "forward: kernels" if any(m in leaf for m in KERNELS) else "forward: dispatch"
    if has(SAMPLING):
        return "sampling"
    # The engine thread is started by moekit/serve: only what the scheduler calls into counts as HTTP there.
    deepest = max((i for i, frame in enumerate(stack) if any(m in frame for m in SCHEDULER)), default=None)
    below = stack if deepest is None else stack[deepest + 1:]
    if any(m in frame for frame in below for m in HTTP):
        return "HTTP/streaming"
    if deepest is not None:
        return "scheduler"
    return "other"


def buckets(raw: str) -> Counter:
    """py-spy's raw (collapsed) output: 'frame;frame;... count' per line, root first."""
    out: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out[bucket(stack.split(";"))] += int(count)
    return out


def profile_moekit(setup: ServeSetup, workload: Workload, seconds: float, rate: int, py_spy: Path, out: Path,
                   moekit_args: str = "") -> dict:
    short, _ = workload.prompts(checkpoint_vocab(setup.checkpoint))
    command = engine_command(parse_vs("", moekit_args)[0], setup, workload, free_port())
    with running(command) as server:
        plan = LoadPlan(url=server.url, prompts=short, max_tokens=workload.max_tokens, model=first_model(server.url))
        run_level(plan, 2, concurrency=1)  # warm
        raw = out / "moekit-serve.pyspy.txt"
        spy = subprocess.Popen([str(py_spy), "record", "--pid", str(server.proc.pid), "--native", "--threads",
                                "--rate", str(rate), "--duration", str(int(seconds)), "--format", "raw",
                                "--output", str(raw)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        levels = []
        done = threading.Event()

        def load() -> None:
            while not done.is_set():
                levels.append(run_level(plan, 2, concurrency=1))

        loader = threading.Thread(target=load)
        loader.start()
        _, err = spy.communicate()
        done.set()
        loader.join()
    if spy.returncode != 0 or not raw.is_file():
        raise SystemExit(f"py-spy failed: {err.strip().splitlines()[-1] if err.strip() else spy.returncode}")
    tokens = sum(level.output_tokens for level in levels)
    wall = sum(level.wall_s for level in levels)
    counts = buckets(raw.read_text())
    counts.pop("idle", None)
    ms = {name: n / rate / tokens * 1e3 for name, n in counts.most_common()}
    itl = sorted(level.itl_s["p50"] for level in levels)  # the median of each pair of requests' medians
    return {"tokens": tokens, "load_wall_s": wall, "tok_s": tokens / wall, "itl_p50_ms": itl[len(itl) // 2] * 1e3,
            "ms_per_token": ms, "samples": sum(counts.values()), "rate_hz": rate}


def llama_itl(setup: ServeSetup, workload: Workload, requests: int) -> dict:
    short, _ = workload.prompts(checkpoint_vocab(setup.checkpoint))
    with running(engine_command(parse_vs("llama-server")[1], setup, workload, free_port())) as server:
        plan = LoadPlan(url=server.url, prompts=short, max_tokens=workload.max_tokens, model=first_model(server.url))
        level = run_level(plan, requests, concurrency=1, warmup=2)
    return {"tok_s": level.output_tok_s, "itl_p50_ms": level.itl_s["p50"] * 1e3, "ttft_p50_ms": level.ttft_s["p50"] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second (each pauses the server a moment)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="dtype", help="moekit's --weights (int8: llama-server on q8_0)")
    parser.add_argument("--moekit-args", default="")
    parser.add_argument("--py-spy", type=Path, default=Path("bench-out/tools/bin/py-spy"))
    parser.add_argument("--out", type=Path, default=Path("bench-out/serve-step-profile"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    setup = ServeSetup(args.checkpoint, args.dtype, args.weights, threads=args.threads, max_batch=16)
    workload = Workload(concurrency=(1,), arrival_count=0)
    report = {"moekit": profile_moekit(setup, workload, args.seconds, args.rate, args.py_spy, args.out, args.moekit_args),
              "llama-server": llama_itl(setup, workload, 8)}
    m, ll = report["moekit"], report["llama-server"]
    print(f"moekit serve: {m['tok_s']:.0f} tok/s under py-spy, ITL p50 {m['itl_p50_ms']:.2f} ms; "
          f"llama-server: {ll['tok_s']:.0f} tok/s, ITL p50 {ll['itl_p50_ms']:.2f} ms")
    for name, ms in m["ms_per_token"].items():
        print(f"  {name:<20} {ms:6.2f} ms/token")
    (args.out / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
