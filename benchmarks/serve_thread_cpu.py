"""What serving costs a token in CPU time, thread by thread: `moekit serve` source trees served in
turn (--tree NAME=SRC), each while c clients stream 64-token completions of 8-token id prompts.

Why CPU time: on a shared machine a token's wall time is mostly the other processes' (a preempted
OpenMP thread stalls its whole team), while the CPU time a thread spends on a token is close to
what it would spend alone. Each thread's time on a CPU is read from /proc/PID/task/TID/schedstat
(nanoseconds) before and after the level and divided by the tokens the clients received:
  event loop  the process's main thread: uvicorn, the routes, the token stream (SSE frames)
  engine      the busiest other thread: the scheduler's steps (the model's arithmetic with
              --threads 1, OpenMP's master share of it with more)
  others      the rest: OpenMP workers (spinning between regions counts), helper threads
With --threads 1 the engine thread's time is the step's arithmetic plus the scheduler's Python,
so the trees' difference there is the scheduler's; the event loop's is the streaming path's.
Beside them the client's ITL and TTFT p50 (wall time, the load's as much as the server's).

  .venv/bin/python benchmarks/serve_thread_cpu.py bench-out/ckpt/qwen3_moe-150m --dtype bfloat16 \\
      --threads 1 --tree main=/work/main/src --tree serve1=src --rounds 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moekit.bench.serve import LoadPlan, first_model, run_level
from moekit.bench.serve_peers import ServeSetup, Workload, checkpoint_vocab, round_order
from moekit.bench.server_launch import free_port, running
from serve_ttft_breakdown import tree_commands


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Each thread of `pid` → nanoseconds it has run on a CPU (schedstat's first field)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return out


def split_threads(pid: int, before: dict[int, int], after: dict[int, int]) -> dict[str, float]:
    """Seconds of CPU per thread group between two readings: event loop, engine, others."""
    spent = {tid: (after[tid] - before.get(tid, 0)) / 1e9 for tid in after}
    loop = spent.pop(pid, 0.0)
    engine_tid = max(spent, key=spent.get, default=None)
    engine = spent.pop(engine_tid, 0.0) if engine_tid is not None else 0.0
    return {"event loop": loop, "engine": engine, "others": sum(spent.values())}


def measure(command, workload: Workload, vocab: int, concurrency: int, requests: int) -> dict:
    short, _ = workload.prompts(vocab)
    with running(command) as server:
        plan = LoadPlan(url=server.url, prompts=short, max_tokens=workload.max_tokens, model=first_model(server.url))
        run_level(plan, workload.warmup, concurrency=1)
        before = thread_cpu_ns(server.proc.pid)
        level = run_level(plan, requests, concurrency=concurrency)
        after = thread_cpu_ns(server.proc.pid)
        cpu = split_threads(server.proc.pid, before, after)
    tokens = level.output_tokens
    per_token = {name: 1e3 * seconds / tokens for name, seconds in cpu.items()}
    return {"tokens": tokens, "errors": level.errors, "tok_s": level.output_tok_s, "itl_p50": 1e3 * level.itl_s["p50"],
            "ttft_p50": 1e3 * level.ttft_s["p50"], **per_token, "all": sum(per_token.values())}


COLUMNS = ("event loop", "engine", "others", "all", "itl_p50", "ttft_p50", "tok_s")


def row(name: str, figures: dict) -> str:
    return f"| {name} | " + " | ".join(f"{figures[c]:.3f}" if c in ("event loop", "engine", "others", "all")
                                      else f"{figures[c]:.1f}" for c in COLUMNS) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=SRC",
                        help="a moekit source tree to serve from (its src/ folder); default: this process's moekit")
    parser.add_argument("--moekit-args", default="", help="more `moekit serve` flags, e.g. --eager")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="dtype")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    workload = Workload(prompt_len=8, max_tokens=args.max_tokens, requests_per_client=1, concurrency=(args.concurrency,),
                        arrival_prompt_len=0, warmup=args.warmup)
    setup = ServeSetup(args.checkpoint, args.dtype, args.weights, args.threads, args.max_batch)
    commands = tree_commands(args.tree, setup, workload, tuple(args.moekit_args.split()))
    names = [c(0).name for c in commands]
    vocab = checkpoint_vocab(args.checkpoint)
    results: list[tuple[str, dict]] = []
    for r in range(args.rounds):
        for make in round_order(commands, r):
            command = make(free_port())
            figures = measure(command, workload, vocab, args.concurrency, args.requests)
            results.append((command.name, figures))
            print(f"round {r + 1}: {row(command.name, figures)}", flush=True)
    print(f"\nc = {args.concurrency}, {args.dtype}, weights {args.weights}, --threads {args.threads}, {args.requests} "
          f"requests of 8-token prompts, {args.max_tokens} tokens each; CPU ms per token received by thread, "
          "the client's ITL and TTFT p50 ms, output tok/s:")
    print("| tree | event loop | engine | others | all | ITL p50 | TTFT p50 | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, figures in sorted(results, key=lambda item: names.index(item[0])):
        print(row(name, figures))


if __name__ == "__main__":
    main()
