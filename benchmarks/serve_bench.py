"""Serving throughput and latency: moekit serve against static batching and llama.cpp's llama-server.

For each dtype, in one run and on the same random token-id prompts (greedy, exactly --max-tokens
output tokens per request, --threads for every side):
  - moekit serve (continuous batching, --max-batch 16) at each concurrency; concurrency 1 is the
    same requests sent one after another (sequential);
  - static batching: `generate()` on batches of `concurrency` prompts, each batch run to the end
    before the next starts (what a server without continuous batching does at best);
  - llama-server (`-np 16`, the GGUF made by llama.cpp's own converter), when --llama-server and a
    GGUF for that dtype are given.

  benchmarks/build_llama_cpp.sh                                          # once: llama-server + converter
  .venv/bin/python benchmarks/serve_bench.py bench-out/ckpt/qwen3_moe-150m --dtypes float32,bfloat16 \
      --json bench-out/serve-150m.json          # GGUFs made by llama.cpp's converter, once, beside the build
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from moekit.bench.serve import LoadPlan, load_prompts, percentiles, run_level


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{url} was not ready in {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def sweep(url: str, prompts, args) -> list[dict]:
    plan = LoadPlan(url=url, prompts=prompts, max_tokens=args.max_tokens, model=None)
    out = []
    for c in args.concurrency:
        level = run_level(plan, max(args.requests, c), concurrency=c, warmup=2)
        out.append(level.as_dict())
        print(f"  c={c:<3} {level.output_tok_s:8.1f} tok/s  TTFT p50 {level.ttft_s['p50'] * 1e3:6.0f} ms  "
              f"ITL p50/p99 {level.itl_s['p50'] * 1e3:5.1f}/{level.itl_s['p99'] * 1e3:5.1f} ms  errors {level.errors}",
              flush=True)
    return out


def server_sweep(cmd: list[str], port: int, prompts, args) -> list[dict]:
    """Start a server process, sweep the concurrencies against it, stop it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        return sweep(f"http://127.0.0.1:{port}", prompts, args)
    finally:
        stop(proc)


def moekit_serve(checkpoint: Path, dtype: str, prompts, args) -> list[dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "moekit", "serve", str(checkpoint), "--port", str(port), "--dtype", dtype,
           "--max-batch", str(args.max_batch), "--threads", str(args.threads)]
    return server_sweep(cmd, port, prompts, args)


def llama_server(binary: Path, gguf: Path, prompts, args) -> list[dict]:
    port = free_port()
    ctx = args.max_batch * (args.prompt_len + args.max_tokens + 8)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(args.max_batch),
           "-c", str(ctx), "-t", str(args.threads), "-tb", str(args.threads), "--no-warmup", "-cb"]
    return server_sweep(cmd, port, prompts, args)


def static_batching(checkpoint: Path, dtype: str, prompts, args) -> list[dict]:
    """generate() on fixed batches: a batch starts when the previous one has finished entirely."""
    import torch

    from moekit.engine.loader import load_engine

    torch.set_num_threads(args.threads)
    engine = load_engine(checkpoint, dtype=dtype)
    engine.generate([prompts[0]], max_new_tokens=4, stop_ids=())  # warm-up
    out = []
    for c in args.concurrency:
        requests = max(args.requests, c)
        started = time.perf_counter()
        e2e, tokens = [], 0
        for begin in range(0, requests, c):
            batch = [prompts[(begin + i) % len(prompts)] for i in range(min(c, requests - begin))]
            t0 = time.perf_counter()
            gen = engine.generate(batch, max_new_tokens=args.max_tokens, stop_ids=(), record_routing=False)
            e2e += [time.perf_counter() - t0] * len(batch)  # a row's reply comes when its batch ends
            tokens += sum(len(t) for t in gen.token_ids)
        wall = time.perf_counter() - started
        step = gen.timing.decode_s / max(gen.timing.decode_steps, 1)
        out.append({"concurrency": c, "requests": requests, "output_tokens": tokens, "wall_s": wall,
                    "output_tok_s": tokens / wall, "e2e_s": percentiles(e2e), "decode_step_s": step})
        print(f"  c={c:<3} {tokens / wall:8.1f} tok/s  (static batches of {c})", flush=True)
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=None, help="random ids below this (default: the model's vocabulary)")
    parser.add_argument("--llama-server", type=Path, help="default: the one benchmarks/build_llama_cpp.sh built")
    parser.add_argument("--gguf", action="append", default=[],
                        help="DTYPE=PATH, the GGUF llama-server runs for that dtype (default: converted once by "
                             "llama.cpp's own convert_hf_to_gguf.py)")
    parser.add_argument("--skip", default="", help="comma-separated sides to skip: moekit,static,llama")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    ggufs = dict(g.split("=", 1) for g in args.gguf)
    if "llama" not in args.skip.split(","):
        from moekit.bench.llama_cpp import ensure_gguf, find_build, gguf_type

        build = find_build()
        args.llama_server = args.llama_server or build.server
        for dtype in args.dtypes.split(","):
            ggufs.setdefault(dtype, str(ensure_gguf(build, args.checkpoint, gguf_type(dtype))))
    vocab = args.vocab or json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    prompts = load_prompts(None, args.prompt_len, vocab, max(args.requests, 16), seed=0)
    skip = set(args.skip.split(","))
    report = {"checkpoint": str(args.checkpoint), "threads": args.threads, "max_tokens": args.max_tokens,
              "prompt_len": args.prompt_len, "max_batch": args.max_batch, "runs": {}}
    for dtype in args.dtypes.split(","):
        runs = report["runs"].setdefault(dtype, {})
        if "moekit" not in skip:
            print(f"{dtype}: moekit serve", flush=True)
            runs["moekit"] = moekit_serve(args.checkpoint, dtype, prompts, args)
        if "static" not in skip:
            print(f"{dtype}: static batching with generate()", flush=True)
            runs["static"] = static_batching(args.checkpoint, dtype, prompts, args)
        if "llama" not in skip and args.llama_server and dtype in ggufs:
            print(f"{dtype}: llama-server {ggufs[dtype]}", flush=True)
            runs["llama-server"] = llama_server(args.llama_server, Path(ggufs[dtype]), prompts, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
