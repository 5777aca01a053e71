"""Expert parallelism on one machine: decode tokens/s, memory per rank and bytes sent per token at
1, 2 and 4 gloo ranks, against the single-process engine, and the simulator's bytes for the same
trace. On a 2-core CPU this measures the exchange's overhead, not a speed-up.

    .venv/bin/python benchmarks/make_checkpoints.py --sizes 150m --families qwen3_moe
    .venv/bin/python benchmarks/expert_parallel.py bench-out/ckpt/qwen3_moe-150m --ranks 1,2,4 --new 32

Each configuration runs in its own process (peak RSS is per process); the table goes to stdout and
the figures as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = list(range(100, 132))  # 32 prompt tokens


def one(checkpoint: str, world: int, new: int, trace: str) -> dict:
    """This process: world <= 0 = the plain single-process engine (at -world threads, 0: torch's
    default); else rank 0 of `world` ranks, each at cores ÷ ranks threads."""
    import resource

    import torch

    from moekit.dist.session import Job, launch, _rss
    from moekit.engine.loader import load_engine
    from moekit.engine.trace import trace_model, write_trace

    timing = {}

    def report(engine, sampling):
        gen = engine.generate(PROMPT, max_new_tokens=new, sampling=sampling, stop_ids=())
        timing.update(gen.timing.as_dict())
        write_trace(gen, trace, trace_model(engine.spec, engine.folder))

    if world <= 0:  # the single-process engine, at -world threads (0: torch's default)
        if world < 0:
            torch.set_num_threads(-world)
        engine = load_engine(checkpoint, compile=False)
        rss = _rss()
        from moekit.engine.sampling import SamplingParams

        report(engine, SamplingParams())
        return {"world": world, "threads": torch.get_num_threads(), "timing": timing, "rss_after_load_bytes": rss,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    job = Job(checkpoint=checkpoint, prompt_ids=PROMPT, max_new_tokens=new, stop_ids=[], timeout_s=600)
    result = launch(job, world, report)
    return {"world": world, "threads": torch.get_num_threads(), "timing": timing, "ranks": result["ranks"]}


def simulated(checkpoint: str, trace: str, world: int) -> list[dict]:
    """The simulator's per-rank figures over the run's trace, at float32 like the run."""
    from moekit.dist.placement import linear_placement
    from moekit.dist.simulate import Cost, read_forwards, simulate
    from moekit.spec import load_spec

    forwards = read_forwards(trace)
    sims = simulate(forwards, linear_placement(forwards.experts, world), Cost(row_bytes=load_spec(checkpoint).hidden_size * 4))
    return [{"pairs": int(sum(s.pairs[r] for s in sims.values())),
             "sent_bytes": int(sum(s.dispatch_bytes[r] + s.combine_bytes[r] for s in sims.values()))}
            for r in range(world)]


def measured(rank: dict) -> dict:
    """The run's figures; per decoded token from its decode steps. (No warm-up run: every rank must
    run the same generate calls, and the workers run only the job's.)"""
    run = list(rank["layers"].values())
    decode_tokens = sum(next(iter(run))["tokens"][1:])
    decode_sent = sum(sum(l["dispatch_bytes"][1:]) + sum(l["combine_bytes"][1:]) for l in run)
    return {"pairs": sum(sum(l["pairs"]) for l in run),
            "sent_bytes": sum(sum(l["dispatch_bytes"]) + sum(l["combine_bytes"]) for l in run),
            "decode_sent_per_token": decode_sent / decode_tokens,
            "gather_per_token": sum(sum(l["gather_bytes"][1:]) for l in run) / decode_tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--out", default="bench-out/expert_parallel.json")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.checkpoint, args.one, args.new, args.trace)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in [0, -1] + [int(r) for r in args.ranks.split(",")]:
            trace = str(Path(tmp) / f"t{world}.parquet")
            proc = subprocess.run([sys.executable, __file__, args.checkpoint, "--one", str(world), "--new", str(args.new),
                                   "--trace", trace], capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                sys.exit(f"world {world} failed: {proc.stderr[-2000:]}")
            row = json.loads(proc.stdout.splitlines()[-1])
            if world > 0:
                row["simulated"] = simulated(args.checkpoint, trace, world)
            rows.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    mib = 1 << 20
    print("| ranks | threads/rank | decode tok/s | RSS after load/shard per rank (MiB) | peak RSS per rank (MiB) |")
    print("|---|---|---|---|---|")
    for row in rows:
        t = row["timing"]["decode_tok_s"]
        if row["world"] <= 0:
            print(f"| single process | {row['threads']} | {t:.1f} | {row['rss_after_load_bytes'] / mib:.0f} | "
                  f"{row['peak_rss_bytes'] / mib:.0f} |")
            continue
        rss = ", ".join(f"{r['rss_after_shard_bytes'] / mib:.0f}" for r in row["ranks"])
        peak = ", ".join(f"{r['peak_rss_bytes'] / mib:.0f}" for r in row["ranks"])
        print(f"| {row['world']} | {row['threads']} | {t:.1f} | {rss} | {peak} |")
    print()
    print("| ranks | rank | pairs computed, measured / simulated | bytes sent (dispatch + combine), measured / simulated "
          "| per decoded token: sent, all-gather |")
    print("|---|---|---|---|---|")
    for row in rows[2:]:
        for r, (rank, sim) in enumerate(zip(row["ranks"], row["simulated"])):
            m = measured(rank)
            print(f"| {row['world']} | {r} | {m['pairs']} / {sim['pairs']} | {m['sent_bytes']} / {sim['sent_bytes']} | "
                  f"{m['decode_sent_per_token']:.0f} B, {m['gather_per_token']:.0f} B |")


if __name__ == "__main__":
    main()
