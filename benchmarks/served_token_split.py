"""One streamed token of `moekit serve` at c = 1, split into its parts, on a wall clock shared by the
server and its client (time.perf_counter is CLOCK_MONOTONIC on Linux, the same in every process).

The app is served in this process by uvicorn on the stack `moekit serve` picks
(moekit.serve.http_stack); one client in a child process (so it takes no GIL from the server)
streams --requests completions of --tokens tokens from an 8-token id prompt, one at a time, and
stamps every socket read that holds SSE frames. The server's own parts are stamped by wrapping, on
the loaded objects, the scheduler's step, the decoder's forward_rows, the compiled step's graph
call (CompiledStep._run), the sampling, the token callback and the dispatcher's wake of the loop.
Per decode step (medians and p90, µs):

  step         one scheduler step, start to start (the engine's inter-token time)
  graph        the compiled graph's call (Inductor's kernels and moekit's operators; with the
               few µs of CompiledStep._run's lookup of the recorded graph)
  step python  forward_rows less the graph (the compiled step's Python)
  sample       the scheduler's sampling (greedy: the row argmax)
  scheduler    the step less forward_rows and sampling (admission, release, meter, callbacks)
  between      one step's end to the next one's start (the run loop; a wait for the GIL)
  to wake      the token's callback on the engine thread → the loop runs the dispatcher's wake
  to client    the token's callback → the client's read that holds its frame (wake, the reply's
               task, the SSE frame, HTTP, the socket)

The scheduler's part and the step's Python are also given as the engine thread's CPU
(time.thread_time): wall less CPU is time it waited, for the GIL or for a core. And counts: loop
wakes per token, client reads per token, and the event loop thread's CPU per token
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
    """Per scheduler step: [start, end, forward_rows, graph, sampling] (perf_counter seconds, the
    last three summed over the step's calls), then the engine thread's CPU seconds in the step, in
    forward_rows, in the graph and in sampling (time.thread_time: not the time it waited for the GIL
    or a core); the token callbacks' and the loop's wakes' times."""

    def __init__(self, profile=None):
        self.on = False
        self.profile = profile  # a cProfile.Profile run around each step, or None
        self.steps: list[list[float]] = []
        self.tokens: list[float] = []  # each token's callback (engine thread)
        self.wakes: list[float] = []  # each run of the dispatcher's wake (event loop)

    def wrap_step(self, obj) -> None:
        fn = obj.step

        def step(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            record = [time.perf_counter(), 0.0, 0.0, 0.0, 0.0, time.thread_time(), 0.0, 0.0, 0.0]
            self.steps.append(record)
            if self.profile is not None:
                self.profile.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.profile is not None:
                    self.profile.disable()
                record[1] = time.perf_counter()
                record[5] = time.thread_time() - record[5]

        obj.step = step

    def wrap_part(self, obj, name: str, index: int) -> None:
        fn = getattr(obj, name)

        def part(*args, **kwargs):
            if not self.on or not self.steps:
                return fn(*args, **kwargs)
            record, start, cpu = self.steps[-1], time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                record[index] += time.perf_counter() - start
                record[index + 4] += time.thread_time() - cpu

        setattr(obj, name, part)


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
    parser.add_argument("--profile", type=int, default=0, help="also cProfile the engine's steps and list this "
                        "many functions by their own time (the parts' times then include the profiler's)")
    args = parser.parse_args()
    if args.llama_server:
        llama_server(args)
        return

    import cProfile

    stamps = Stamps(cProfile.Profile() if args.profile else None)

    def ready(state) -> None:
        scheduler = state.scheduler
        stamps.wrap_step(scheduler)
        stamps.wrap_part(scheduler.decoder, "forward_rows", 2)
        if scheduler.decoder.compiled is not None:
            stamps.wrap_part(scheduler.decoder.compiled, "_run", 3)
        stamps.wrap_part(scheduler, "_sample", 4)

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
            client = warmed_client(port, args.tokens)
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
    if stamps.profile is not None:
        import pstats

        pstats.Stats(stamps.profile).sort_stats("tottime").print_stats(args.profile)


def warmed_client(port: int, tokens: int) -> list[str]:
    """The client's command line, after one warm-up run of 2 requests against the server on `port`."""
    client = [sys.executable, "-c", CLIENT, str(port)]
    warm = subprocess.run(client + ["2", str(tokens)], capture_output=True, text=True)
    if warm.returncode:
        raise SystemExit(f"the client failed: {warm.stderr.strip().splitlines()[-1:]}")
    return client


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
        client = warmed_client(port, args.tokens)
        done = json.loads(subprocess.run(client + [str(args.requests), str(args.tokens)], check=True,
                                         capture_output=True, text=True).stdout)
    finally:
        server.terminate()
        server.wait()
    gaps, rests = [], []
    for request, timings in zip(done["reads"], done["timings"]):
        times = [t for t, n in request for _ in range(n)][:-1]  # the tokens' frames (the last: the finish)
        gaps += [b - a for a, b in zip(times, times[1:])]
        # Per request: the client's mean time a token after the first against the server's own eval.
        own = timings["predicted_ms"] / 1e3 / max(timings["predicted_n"], 1)
        rests.append((times[-1] - times[0]) / max(len(times) - 1, 1) - own)
    print(f"llama-server {args.checkpoint.name}, threads {args.threads}: client frame gap p50 "
          f"{median_us(gaps):.1f} µs; per request, the client's mean gap less llama-server's own eval per "
          f"token (timings.predicted_ms / predicted_n): median {median_us(rests):.1f} µs")


def report(args, stack, stamps: Stamps, result: dict) -> None:
    reads = [read for request in result["reads"] for read in request]
    frames = sum(n for _, n in reads)
    tokens = stamps.tokens
    # Decode steps only (one forward_rows, no prefill): a step whose next one starts within 0.5 s.
    steps = [(record, following[0]) for record, following in zip(stamps.steps, stamps.steps[1:])
             if following[0] - record[0] < 0.5 and record[2] > 0]
    has_graph = any(record[3] for record, _ in steps)
    parts = {
        "step, start to start": [nxt - r[0] for r, nxt in steps],
        "graph (the compiled step's call)": [r[3] for r, _ in steps] if has_graph else [],
        "step python (forward_rows less graph)": [r[2] - r[3] for r, _ in steps],
        "sample": [r[4] for r, _ in steps],
        "scheduler (the step less forward_rows, sample)": [r[1] - r[0] - r[2] - r[4] for r, _ in steps],
        "  of which the engine thread's CPU": [r[5] - r[6] - r[8] for r, _ in steps],
        "step python, the engine thread's CPU": [r[6] - r[7] for r, _ in steps],
        "between steps (run loop, waits)": [nxt - r[1] for r, nxt in steps],
    }
    # The last frame of each request is its finish frame (no token); the reads in order, each
    # covering `n` frames, the tokens in order.
    arrivals = [t for request in result["reads"] for t in [t for t, n in request for _ in range(n)][:-1]]
    parts["token callback -> client read"] = ([a - t for t, a in zip(tokens, arrivals)]
                                              if len(arrivals) == len(tokens) else [])
    wakes, to_wake, j = stamps.wakes, [], 0
    for t in tokens:
        while j < len(wakes) and wakes[j] < t:
            j += 1
        if j < len(wakes):
            to_wake.append(wakes[j] - t)
    parts["token callback -> loop wake"] = to_wake
    n = len(tokens)
    print(f"{args.checkpoint} {args.dtype}, threads {args.threads}, {stack.loop} + {stack.http}: "
          f"{n} tokens ({frames} frames read by the client), {len(steps)} decode steps; medians (p90) µs")
    for name, values in parts.items():
        p90 = sorted(values)[int(0.9 * (len(values) - 1))] * 1e6 if values else float("nan")
        print(f"  {name:50s} {median_us(values):8.1f} ({p90:.0f})")
    print(f"  loop wakes per token {len(wakes) / n:.2f}, client reads per token {len(reads) / n:.2f}, "
          f"the event loop's CPU per token {result['cpu'] / n / 1e3:.1f} µs")


if __name__ == "__main__":
    main()
