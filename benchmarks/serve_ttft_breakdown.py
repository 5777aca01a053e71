"""Where a served request's time to first token goes: moekit serve's stages beside the wait its
client sees, and llama-server's TTFT on the same workload, in one run.

Workload: issue 35's (moekit.bench.serve_peers.Workload): c clients each streaming --per-client
completions of --prompt-len random token ids, --max-tokens tokens each, greedy. For every moekit
source tree given (--tree NAME=SRC: e.g. main's tree and this one, each served from its own
PYTHONPATH, so a change is measured against what it changes in the same run), the server's
/metrics is read before and after the level, and each stage's mean is taken from the histogram
moekit:first_token_stage_seconds (a tree without it shows its queue histogram, and the rest of
its engine TTFT as prefill; no parse or stream):
  parse    the route's start (body read) to the request queued: validation, tokenizing;
  queue    queued to admitted: the step that was running when it came, and the step's release;
  prefill  admitted to its first token sampled: the prefill's forward and the sampling;
  stream   the first token sampled to its frame written: the event loop's hand-off and the SSE frame;
  rest     the client's mean TTFT less those: its request's way in (connection, HTTP parsing before
           the route) and the frame's way out to the client.
Beside them, the mean gap between a request's tokens as the engine thread produced them
(moekit:inter_token_latency_seconds: the scheduler's step, what `moekit bench decode` times
without a server) and as the client read them (ITL mean).
Engines run one at a time, their order rotated each round; each is warmed up first (--warmup
requests, not counted).

  .venv/bin/python benchmarks/serve_ttft_breakdown.py bench-out/ckpt/qwen3_moe-150m --concurrency 4 \\
      --threads 1 --tree main=/work/main/src --tree ttft=src --vs llama-server --rounds 2
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from moekit.bench.serve import LoadPlan, first_model, run_level
from moekit.bench.serve_peers import (ServeSetup, Workload, checkpoint_vocab, llama_server_command, moekit_command,
                                      round_order)
from moekit.bench.server_launch import free_port, running

STAGES = ("parse", "queue", "prefill", "stream")
FAMILY = "moekit:first_token_stage_seconds"
OTHERS = {"moekit:inter_token_latency_seconds": "itl", "moekit:request_queue_time_seconds": "queue_time",
          "moekit:time_to_first_token_seconds": "engine_ttft"}  # engine_ttft: queued to the first token sampled


def latency_totals(url: str) -> dict[str, tuple[float, float]]:
    """Each stage of FAMILY, and each of OTHERS by its short name → (sum of seconds, count) over
    every tier, from the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if family.name != FAMILY and family.name not in OTHERS:
            continue
        for sample in family.samples:
            total = out.setdefault(sample.labels["stage"] if family.name == FAMILY else OTHERS[family.name], [0.0, 0.0])
            if sample.name.endswith("_sum"):
                total[0] += sample.value
            elif sample.name.endswith("_count"):
                total[1] += sample.value
    return {name: (total, count) for name, (total, count) in out.items()}


def means_ms(before: dict, after: dict) -> dict[str, float]:
    """Each latency's mean over the requests between two readings, in ms."""
    out = {}
    for name in after.keys() & before.keys():
        total, count = (a - b for a, b in zip(after[name], before[name]))
        out[name] = 1000 * total / count if count else float("nan")
    return out


def measure(command, workload: Workload, vocab: int, concurrency: int) -> dict:
    """One engine: started, warmed up, one level run; its figures."""
    short, _ = workload.prompts(vocab)
    moekit = command.name != "llama-server"
    with running(command) as server:
        plan = LoadPlan(url=server.url, prompts=short, max_tokens=workload.max_tokens, model=first_model(server.url))
        run_level(plan, workload.warmup, concurrency=1)
        before = latency_totals(server.url) if moekit else {}
        level = run_level(plan, workload.requests_per_client * concurrency, concurrency=concurrency)
        after = latency_totals(server.url) if moekit else {}
    means = means_ms(before, after)
    ttft_mean = 1000 * level.ttft_s["mean"]
    figures = {"tok_s": level.output_tok_s, "ttft_p50": 1000 * level.ttft_s["p50"], "ttft_mean": ttft_mean,
               "errors": level.errors, "itl": 1000 * level.itl_s["mean"], "engine_itl": means.get("itl")}
    if moekit and "prefill" not in means:  # a tree without the stages: its queue, and the rest of its engine TTFT
        means["queue"], means["prefill"] = means["queue_time"], means["engine_ttft"] - means["queue_time"]
    figures.update({stage: means[stage] for stage in STAGES if stage in means})
    if all(stage in means for stage in STAGES):
        figures["rest"] = ttft_mean - sum(means[stage] for stage in STAGES)
    return figures


def row(name: str, figures: dict) -> str:
    cells = [f"{figures['tok_s']:.0f}", f"{figures['ttft_p50']:.1f}", f"{figures['ttft_mean']:.1f}"]
    for stage in (*STAGES, "rest", "engine_itl", "itl"):
        value = figures.get(stage)
        cells.append("—" if value is None or value != value else f"{value:.1f}")
    return f"| {name} | " + " | ".join(cells) + " |"


def tree_commands(trees: list[str], setup: ServeSetup, workload: Workload, flags: tuple[str, ...]) -> list:
    """Each --tree NAME=SRC (none: this process's moekit, named "moekit") → a port → its `moekit serve` command."""
    commands = []
    for name, src in [tuple(t.split("=", 1)) for t in trees] or [("moekit", "")]:
        # SRC may list folders (os.pathsep between): a tree with packages installed apart, e.g. src:/tmp/deps.
        env = {"PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in src.split(os.pathsep))} if src else {}
        # A cold start compiles the step's graphs: at a high load that is past the usual 600 s.
        commands.append(lambda port, n=name, e=env: replace(moekit_command(setup, workload, flags, port), name=n, env=e,
                                                            ready_timeout_s=3600.0))
    return commands


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=SRC",
                        help="a moekit source tree to serve from (its src/ folder); default: this process's moekit")
    parser.add_argument("--vs", default="llama-server", help="llama-server, or '' for moekit alone")
    parser.add_argument("--moekit-args", default="", help="more `moekit serve` flags, e.g. --eager")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="dtype", help="moekit's --weights (int8: llama-server on q8_0)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--per-client", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    workload = Workload(prompt_len=args.prompt_len, max_tokens=args.max_tokens, requests_per_client=args.per_client,
                        concurrency=(args.concurrency,), arrival_prompt_len=0, warmup=args.warmup)
    setup = ServeSetup(args.checkpoint, args.dtype, args.weights, args.threads, args.max_batch)
    commands = tree_commands(args.tree, setup, workload, tuple(args.moekit_args.split()))
    if args.vs == "llama-server":
        commands.append(lambda port: llama_server_command(setup, workload, port))
    vocab = checkpoint_vocab(args.checkpoint)
    names = [c(0).name for c in commands]
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for make in round_order(commands, r):
            command = make(free_port())
            figures = measure(command, workload, vocab, args.concurrency)
            results[command.name].append(figures)
            print(f"round {r + 1}: {row(command.name, figures)}", flush=True)
    print(f"\nc = {args.concurrency}, {args.dtype}, weights {args.weights}, {args.per_client} x c requests of "
          f"{args.prompt_len}-token prompts, {args.max_tokens} tokens each; ms, means except TTFT p50:")
    print("| engine | tok/s | TTFT p50 | TTFT mean | parse | queue | prefill | stream | rest | engine ITL mean | ITL mean |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for figures in results[name]:
            print(row(name, figures))


if __name__ == "__main__":
    main()
