"""Python calls per streamed token on `moekit serve`'s event loop thread at c = 1: the app served
in this process by uvicorn (its default HTTP and loop implementations, or the ones named), one
client on another thread streaming 64-token completions of an 8-token id prompt.

A count, not a time, so that a loaded machine does not change it: sys.setprofile on the loop's
thread counts "call" events (a coroutine or generator resumed counts again: each level of an await
chain costs a frame per token) and "c_call" events while the client's timed requests run, divided
by the tokens they received; the most frequent functions are listed. Time-driven calls (uvicorn's
0.1 s tick) count too, more so the slower the tokens come.

  PYTHONPATH=src .venv/bin/python benchmarks/serve_loop_calls.py models/moekit-demo --requests 8
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import uvicorn

from moekit.serve.app import ServeConfig, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--http", default="auto", help="uvicorn's --http: auto, h11 or httptools")
    parser.add_argument("--loop", default="auto", help="uvicorn's --loop: auto, asyncio or uvloop")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()

    config = ServeConfig(checkpoint=args.checkpoint, model_name="m", dtype=args.dtype, max_batch=16, max_context=72,
                         threads=args.threads)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning",
                                           http=args.http, loop=args.loop, access_log=False))
    counting = threading.Event()
    result: dict = {}

    def client() -> None:
        url = f"http://127.0.0.1:{port}"
        body = {"model": "m", "prompt": list(range(3, 11)), "max_tokens": 64, "stream": True, "ignore_eos": True,
                "temperature": 0}
        try:
            while True:
                try:
                    health = httpx.get(url + "/health")
                    if health.status_code == 200 and health.json().get("graphs") == "ready":
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            with httpx.Client(timeout=600) as session:
                def one() -> int:
                    with session.stream("POST", url + "/v1/completions", json=body) as response:
                        return sum(line.startswith("data: {") for line in response.iter_lines())

                one(), one()  # warm
                counting.set()
                start = time.perf_counter()
                result["tokens"] = sum(one() for _ in range(args.requests))
                result["wall"] = time.perf_counter() - start
                counting.clear()
        finally:
            server.should_exit = True

    calls: Counter = Counter()
    native: Counter = Counter()

    def profile(frame, event, arg):
        if not counting.is_set():
            return
        if event == "call":
            code = frame.f_code
            calls[f"{code.co_filename.split('site-packages/')[-1].split('/lib/python3')[-1]}:{code.co_name}"] += 1
        elif event == "c_call":
            native[getattr(arg, "__qualname__", str(arg))] += 1

    threading.Thread(target=client, daemon=True).start()
    sys.setprofile(profile)  # this thread's only: the one uvicorn's loop runs on
    try:
        server.run()
    finally:
        sys.setprofile(None)
    tokens = result.get("tokens")
    if not tokens:
        raise SystemExit("no tokens were streamed")
    print(f"http={args.http} loop={args.loop}: {tokens} tokens in {result['wall']:.2f} s; per token on the event loop: "
          f"{sum(calls.values()) / tokens:.1f} Python calls, {sum(native.values()) / tokens:.1f} C calls")
    for name, n in calls.most_common(args.top):
        print(f"  {n / tokens:6.2f}  {name}")


if __name__ == "__main__":
    main()
