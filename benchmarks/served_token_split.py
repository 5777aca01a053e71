"""One streamed token of `moekit serve` at c = 1, split into its parts, on a wall clock shared by the
server and its client (time.perf_counter is CLOCK_MONOTONIC on Linux, the same in every process).

The app is served in this process by uvicorn on the stack `moekit serve` picks
(moekit.serve.http_stack); one client in a child process (so it takes no GIL from the server)
streams --requests completions of --tokens tokens from an 8-token id prompt, one at a time, and
stamps every socket read that holds SSE frames. The server's own parts are stamped by wrapping, on
the loaded objects, the scheduler's step, the decoder's forward_rows, the compiled step's graph
call (CompiledStep._run), the sampling, the token callback and the dispatcher's wake of the loop.
Per generated token after the first (medians, µs):

  step         one scheduler step, start to start (the engine's inter-token time)
  graph        the compiled graph's call (Inductor's kernels and moekit's operators)
  step python  forward_rows less the graph (the compiled step's Python)
  sample       the scheduler's sampling (greedy: the row argmax)
  scheduler    the step less forward_rows and sampling (admission, release, meter, callbacks)
  to wake      the token's callback on the engine thread → the loop runs the dispatcher's wake
  to client    the token's callback → the client's read that holds its frame (wake, the reply's
               task, the SSE frame, HTTP, the socket)

and counts: loop wakes per token, client reads per token, and the event loop thread's CPU per token
(/proc/self/task/TID/schedstat).

  PYTHONPATH=src .venv/bin/python benchmarks/served_token_split.py models/moekit-demo --threads 2
  PYTHONPATH=src .venv/bin/python benchmarks/served_token_split.py bench-out/ckpt/qwen3_moe-150m --dtype bfloat16
  .venv/bin/python benchmarks/served_token_split.py bench-out/llama.cpp/gguf/moekit-demo-b7c05559-f32.gguf --llama-server

With --llama-server the same client reads llama-server's stream (started as `moekit bench serve --vs
llama-server` starts it, one slot), and its own `timings` give its eval time per generated token.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn

import moekit.serve.streaming as streaming
from moekit.serve.app import ServeConfig, create_app
from moekit.serve.http_stack import http_stack

CLIENT = r"""
import json, socket, sys, time
port, requests, tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
body = json.dumps({"model": "m", "prompt": list(range(3, 11)), "max_tokens": tokens, "stream": True,
                   "ignore_eos": True, "temperature": 0}).encode()
head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n").encode()
out, timings = [], []
for _ in range(requests):
    with socket.create_connection(("127.0.0.1", port)) as s:  # one each: llama-server closes after a stream
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reads, whole = [], b""
        s.sendall(head + body)
        while b"data: [DONE]" not in whole[-64:]:
            chunk = s.recv(65536)
            now = time.perf_counter()
            if not chunk:
                raise SystemExit("the server closed the connection")
            frames = chunk.count(b"data: {")
            if frames:
                reads.append((now, frames))
            whole += chunk
        while not whole.endswith(b"0\r\n\r\n"):  # the chunked body's end
            whole += s.recv(65536)
        out.append(reads)
        for line in whole.split(b"\n"):
            if line.startswith(b"data: {") and b'"timings"' in line:
                timings.append(json.loads(line[6:])["timings"])
print(json.dumps({"reads": out, "timings": timings}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_cpu_ns(tid: int) -> int:
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])


class Stamps:
    """Wall-clock stamps (perf_counter seconds) of the server's parts, appended from whichever thread."""

    def __init__(self):
        self.on = False
        self.steps: list[float] = []  # each step's start
        self.forward: list[float] = []  # forward_rows' wall, per call
        self.graph: list[float] = []
        self.sample: list[float] = []
        self.tokens: list[float] = []  # each token's callback
        self.wakes: list[float] = []  # each run of the dispatcher's wake, on the loop

    def wrap(self, obj, name: str, into: list | None = None, starts: list | None = None) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            if starts is not None:
                starts.append(start)
            try:
                return fn(*args, **kwargs)
            finally:
                if into is not None:
                    into.append(time.perf_counter() - start)

        setattr(obj, name, wrapper)


def median_us(values) -> float:
    return statistics.median(values) * 1e6 if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--llama-server", action="store_true", help="the checkpoint is a GGUF: serve it with "
                        "llama-server (--llama-binary) instead: the client's frames against its own eval per token")
    parser.add_argument("--llama-binary", type=Path, default=Path("bench-out/llama.cpp/server-build/bin/llama-server"))
    args = parser.parse_args()
    if args.llama_server:
        llama_server(args)
        return

    stamps = Stamps()

    def ready(state) -> None:
        scheduler = state.scheduler
        stamps.wrap(scheduler, "step", starts=stamps.steps)
        stamps.wrap(scheduler, "_sample", into=stamps.sample)
        stamps.wrap(scheduler.decoder, "forward_rows", into=stamps.forward)
        if scheduler.decoder.compiled is not None:
            stamps.wrap(scheduler.decoder.compiled, "_run", into=stamps.graph)

    flush = streaming.Dispatcher._flush

    def stamped_flush(self):
        if stamps.on:
            stamps.wakes.append(time.perf_counter())
        flush(self)

    streaming.Dispatcher._flush = stamped_flush  # this process's server only: the stamp beside the wake
    put = streaming.Dispatcher.put

    def stamped_put(self, box, item):
        if stamps.on and item[1] == "token":
            stamps.tokens.append(time.perf_counter())
        put(self, box, item)

    streaming.Dispatcher.put = stamped_put

    config = ServeConfig(checkpoint=args.checkpoint, model_name="m", dtype=args.dtype, max_batch=16, max_context=96,
                         threads=args.threads)
    stack = http_stack()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config, on_ready=ready), host="127.0.0.1", port=port,
                                           log_level="warning", http=stack.http, loop=stack.loop, access_log=False))
    result: dict = {}
    loop_tid = threading.get_native_id()

    def drive() -> None:
        import httpx

        try:
            while True:
                try:
                    health = httpx.get(f"http://127.0.0.1:{port}/health")
                    if health.status_code == 200 and health.json().get("graphs") == "ready":
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            client = [sys.executable, "-c", CLIENT, str(port)]
            warm = subprocess.run(client + ["2", str(args.tokens)], capture_output=True, text=True)  # warm
            if warm.returncode:
                raise SystemExit(f"the client failed: {warm.stderr.strip().splitlines()[-1:]}")
            cpu0 = thread_cpu_ns(loop_tid)
            stamps.on = True
            done = subprocess.run(client + [str(args.requests), str(args.tokens)], check=True, capture_output=True,
                                  text=True)
            stamps.on = False
            cpu1 = thread_cpu_ns(loop_tid)
            result["reads"] = json.loads(done.stdout)["reads"]
            result["cpu"] = cpu1 - cpu0
        finally:
            server.should_exit = True

    threading.Thread(target=drive, daemon=True).start()
    server.run()
    if "reads" not in result:
        raise SystemExit("the client got no tokens")
    report(args, stack, stamps, result)


def llama_server(args) -> None:
    """The same client against llama-server (as `moekit bench serve --vs llama-server` starts it, one
    slot): the gaps between its frames, and its own timings' eval time per generated token."""
    import httpx

    port = free_port()
    threads = str(args.threads)
    argv = [str(args.llama_binary), "-m", str(args.checkpoint), "--host", "127.0.0.1", "--port", str(port),
            "-np", "1", "-c", "512", "-t", threads, "-tb", threads, "--no-warmup", "-cb"]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        client = [sys.executable, "-c", CLIENT, str(port)]
        warm = subprocess.run(client + ["2", str(args.tokens)], capture_output=True, text=True)  # warm
        if warm.returncode:
            raise SystemExit(f"the client failed: {warm.stderr.strip().splitlines()[-1:]}")
        done = json.loads(subprocess.run(client + [str(args.requests), str(args.tokens)], check=True,
                                         capture_output=True, text=True).stdout)
    finally:
        server.terminate()
        server.wait()
    gaps = []
    for request in done["reads"]:
        times = [t for t, n in request for _ in range(n)]
        gaps += [b - a for a, b in zip(times[1:], times[2:])]  # after the first token's
    per_token = [t["predicted_ms"] / 1e3 / max(t["predicted_n"], 1) for t in done["timings"]]
    print(f"llama-server {args.checkpoint.name}, threads {args.threads}: client frame gap p50 "
          f"{median_us(gaps):.1f} µs; its own eval per token {median_us(per_token):.1f} µs "
          f"(the rest of a token: {median_us(gaps) - median_us(per_token):.1f} µs)")


def report(args, stack, stamps: Stamps, result: dict) -> None:
    reads = [read for request in result["reads"] for read in request]
    frames = sum(n for _, n in reads)
    tokens = stamps.tokens
    steps = stamps.steps
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b - a < 0.5]  # not across requests' idle waits
    forward = stamps.forward
    graph = stamps.graph if stamps.graph else [0.0] * len(forward)
    # Each token's callback → the client's read that held its frame: the reads in order, each
    # covering `n` frames, the tokens in order.
    # The last frame of each request is its finish frame (no token).
    arrivals = [t for request in result["reads"] for t in [t for t, n in request for _ in range(n)][:-1]]
    to_client = [a - t for t, a in zip(tokens, arrivals)] if len(arrivals) == len(tokens) else []
    to_wake = []
    wakes = stamps.wakes
    j = 0
    for t in tokens:
        while j < len(wakes) and wakes[j] < t:
            j += 1
        if j < len(wakes):
            to_wake.append(wakes[j] - t)
    n = len(tokens)
    step = median_us(gaps)
    parts = {
        "step (start to start)": step,
        "graph": median_us(graph),
        "step python (forward_rows less graph)": median_us([f - g for f, g in zip(forward, graph)]),
        "sample": median_us(stamps.sample),
        "scheduler (step less forward_rows, sample)": step - median_us(forward) - median_us(stamps.sample),
        "token callback -> loop wake": median_us(to_wake),
        "token callback -> client read": median_us(to_client),
    }
    print(f"{args.checkpoint} {args.dtype}, threads {args.threads}, {stack.loop} + {stack.http}: "
          f"{n} tokens ({frames} frames read by the client), {len(steps)} steps")
    for name, value in parts.items():
        print(f"  {name:45s} {value:8.1f} µs")
    print(f"  loop wakes per token {len(wakes) / n:.2f}, client reads per token {len(reads) / n:.2f}")
    print(f"  the event loop's CPU per token {result['cpu'] / n / 1e3:.1f} µs")


if __name__ == "__main__":
    main()
