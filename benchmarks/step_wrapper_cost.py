"""The Python around one compiled decode step at batch 1: what Decoder.forward_rows (a served row's
step) and generate's loop (Decoder.forward, T = 1) spend besides the graph's own code.

Counts first, since they do not depend on the machine's load: Python and C calls per token
(sys.setprofile's "call" / "c_call" events) inside forward_rows, and in generate's decode loop
inside Decoder.forward and outside it (the bare loop: sampling, the buffers). Then the µs a step
of forward_rows and of Decoder.forward at T = 1 with the graphs' compiled code left out (each
recorded graph's run replaced by one that hands back a real call's outputs: only the Python around
it is timed, as this thread's CPU time, on one thread), medians of --rounds rounds. The whole
step's time is `moekit bench decode`'s (benchmarks/decode_ab.py compares two trees').
Runs under any tree (PYTHONPATH) whose CompiledStep records direct graphs, so two trees can be
compared in turn:

  PYTHONPATH=src .venv/bin/python benchmarks/step_wrapper_cost.py bench-out/ckpt/qwen3_moe-150m --dtype bfloat16
  PYTHONPATH=src .venv/bin/python benchmarks/step_wrapper_cost.py models/moekit-demo
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from moekit.engine.generate import generate
from moekit.engine.loader import load_engine
from moekit.model.cache import copy_row

from served_step_cost import call_counts  # keys: "forward" / "forward C" inside the code, "outside" / "outside C"


def stub_graphs(step) -> None:
    """Replace each recorded graph's compiled code with one that returns the outputs of its first real call."""
    for graph in step.graphs:
        run, kept = graph.run, []

        def stub(*args, run=run, kept=kept):
            if not kept:
                kept.append(list(run(*args)))
            return list(kept[0])

        object.__setattr__(graph, "run", stub)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="dtype")
    parser.add_argument("--threads", type=int, default=2, help="while the graphs compile (the timing runs on 1)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000, help="steps a round")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    engine = load_engine(args.checkpoint, dtype=args.dtype, weights=args.weights)
    decoder = engine.decoder
    if decoder.compiled is None:
        raise SystemExit("the decode step is not compiled here: nothing to measure")
    decoder.compiled.warm_up((1,))
    prompt, new = list(range(3, 11)), args.tokens
    cache = decoder.new_cache(1, len(prompt) + new)
    with torch.inference_mode():
        single = decoder.new_cache(1, len(prompt))
        first = decoder(torch.tensor([prompt]), single, torch.arange(len(prompt))[None], None, last_only=True)
        copy_row(cache, 0, single, 0, len(prompt))
    token = int(first[0, -1].argmax())

    def rows(steps: int) -> list[int]:
        """steps served-style steps of one row (forward_rows, the argmax), from the prompt's end."""
        out, t = [], token
        with torch.inference_mode():
            for length in range(len(prompt), len(prompt) + steps):
                t = int(decoder.forward_rows(torch.tensor([[t]]), cache, torch.tensor([length]), None)[0, -1].argmax())
                out.append(t)
        return out

    def generated(tokens: int = new) -> list[int]:
        return generate(decoder, [prompt], tokens, record_routing=False).token_ids[0]

    if rows(new - 1) != generated()[1:]:
        raise SystemExit("forward_rows and generate gave different tokens")
    steps = new - 1
    counts = call_counts(lambda: rows(steps), type(decoder).forward_rows.__code__)
    print("forward_rows, calls per token: " + f"Python {counts['forward'] / steps:.1f} / C {counts['forward C'] / steps:.1f}")
    # A decode step's share: a run of `new` tokens less a run of half as many (the prefill and set-up cancel).
    half = new // 2
    counts = call_counts(generated, type(decoder).forward.__code__)
    counts.subtract(call_counts(lambda: generated(half), type(decoder).forward.__code__))
    each = {k: v / (new - half) for k, v in counts.items()}
    print("generate's decode loop, calls per token: "
          + f"Decoder.forward Python {each['forward']:.1f} / C {each['forward C']:.1f}, "
          + f"outside it Python {each['outside']:.1f} / C {each['outside C']:.1f}")

    # The wrapper's time is this thread's CPU time (time.thread_time): a loaded machine preempts the
    # thread, which wall time would count; on one thread, nothing of the step runs elsewhere. The
    # same token into the same slot each call (the stub's outputs do not depend on it).
    torch.set_num_threads(1)
    ids, length = torch.tensor([[token]]), torch.tensor([len(prompt)])
    step_cache = decoder.new_cache(1, len(prompt) + 4)
    positions = torch.tensor([[len(prompt)]])
    with torch.inference_mode():
        decoder(torch.tensor([prompt]), step_cache, torch.arange(len(prompt))[None])

    def served() -> None:
        decoder.forward_rows(ids, cache, length, None)

    def generates() -> None:  # generate's step: Decoder.forward at T = 1
        step_cache.length = len(prompt)
        decoder(ids, step_cache, positions, None)

    with torch.inference_mode():  # each graph the timed calls take, recorded before it is stubbed
        served(), generates()
    stub_graphs(decoder.compiled)
    wrapper: dict[str, list[float]] = {"forward_rows": [], "Decoder.forward": []}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for name, fn in (("forward_rows", served), ("Decoder.forward", generates)):
                began = time.thread_time_ns()
                for _ in range(args.calls):
                    fn()
                if r:  # the first round warms up
                    wrapper[name].append((time.thread_time_ns() - began) / args.calls / 1e3)
    print("the Python around the graph (its code stubbed; 1 thread, CPU time), µs a step: "
          + ", ".join(f"{k} {statistics.median(v):.1f} (min {min(v):.1f})" for k, v in wrapper.items()))



if __name__ == "__main__":
    main()
