"""A burst whose late part arrives during its first request's prefill: this tree's scheduler
against another tree's (e.g. main's), on one decoder in one process, alternating.

The scheduler is idle; one request is submitted, and when its first token is sampled (right after
its prefill, on the scheduler's thread, before the step's decode) the burst's other c - 1 arrive.
Per trial: the late part's mean TTFT (queued to its first token) and the wall time until all c
have their --max-tokens tokens. The arrival time is a model (the late part lands exactly at the
end of the first prefill), so this measures what admitting them in the same step changes, not a
client's TTFT (benchmarks/serve_ttft_breakdown.py measures that).

  PYTHONPATH=src .venv/bin/python benchmarks/burst_admission_ab.py bench-out/ckpt/qwen3_moe-150m \\
      --against /work/main/src/moekit/engine/scheduler.py --burst 4 --trials 5
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def trial(module, decoder, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """→ (the late part's mean TTFT, the burst's wall time), seconds."""
    scheduler = module.Scheduler(decoder, max_batch=16, max_len=len(prompts[0]) + max_tokens, prefill_tokens=128)
    requests = [module.Request(prompt=p, max_new_tokens=max_tokens) for p in prompts]
    outcomes: dict[int, object] = {}
    for i, request in enumerate(requests):
        request.on_finish = lambda outcome, i=i: outcomes.__setitem__(i, outcome)
    late = requests[1:]
    requests[0].on_token = lambda token: None if late[0].submitted_at else scheduler.submit_all(late)
    started = time.perf_counter()
    scheduler.submit(requests[0])
    scheduler.run_until_idle()
    wall = time.perf_counter() - started
    ttft = statistics.fmean(outcomes[i].first_token_at - outcomes[i].submitted_at for i in range(1, len(requests)))
    return ttft, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--against", type=Path, required=True, help="the other tree's engine/scheduler.py")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from moekit.engine import scheduler as ours
    from moekit.engine.loader import load_engine
    from moekit.model.compiled_step import SERVED_PREFILLS

    torch.set_num_threads(args.threads)
    theirs = load_module(args.against, "scheduler_against")
    engine = load_engine(args.checkpoint, dtype=args.dtype)
    engine.decoder.compiled.warm_up(prefills=SERVED_PREFILLS)  # what `moekit serve` compiles before it is ready
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    results: dict[str, list[tuple[float, float]]] = {"this tree": [], "against": []}
    for t in range(args.trials + 1):  # the first round warms both up and is not counted
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.burst)]
        order = [("this tree", ours), ("against", theirs)]
        for name, module in order if t % 2 == 0 else order[::-1]:
            figures = trial(module, engine.decoder, prompts, args.max_tokens)
            if t:
                results[name].append(figures)
    med = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for name, rs in results.items()}
    print(f"burst of {args.burst}, {args.prompt_len}-token prompts, {args.max_tokens} tokens, {args.dtype}, "
          f"{args.threads} thread(s), medians of {args.trials}:")
    for name, (ttft, wall) in med.items():
        print(f"  {name:10s} late part's TTFT {ttft * 1000:7.1f} ms   burst's wall {wall * 1000:7.1f} ms")
    print(f"  this tree ÷ against: TTFT {med['this tree'][0] / med['against'][0]:.2f}x, "
          f"wall {med['this tree'][1] / med['against'][1]:.2f}x")
    engine.close()


if __name__ == "__main__":
    main()
